"""Drawing a case's examples: its edge cases first, then hypothesis-drawn parameter sets.

Drawing happens once in the parent process (deterministically, ``derandomize=True``) so a
multi-rank case sends every rank the same examples, and a run is repeatable. Hypothesis also
draws, now and then, integer and float literals it finds in the *local* modules loaded at that
moment (``hypothesis.internal.conjecture.providers``: its "local constants"); which modules are
loaded depends on what the process imported before (a test session that also collected the
report tests, the branch-coverage trace, the ``parity`` command) and on whether the package is
an editable install. The draws here leave that pool out, so a case's examples are the same in
every process and install; the drawn values stay those of the strategy.

``quick`` is the edge cases plus a few draws. ``full`` is everything ``quick`` runs plus
draws of *distinct shapes*: a draw is kept only if its shape key (the integer parameters other
than the seed: sequence lengths, batch, heads, hidden sizes, windows ...) differs from every
example already chosen, so full mode never spends its time on near-duplicates that differ
from a quick example only in a seed or a scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from megatron_npu.parity.case import ParityCase

#: Hypothesis-drawn examples per (case, dtype, parallel size, device) in each mode; full mode
#: adds up to ``EXAMPLES["full"]`` examples of new shapes on top of quick's.
EXAMPLES = {"quick": 2, "full": 10}
#: parameters that never define a shape
_NOT_SHAPE = frozenset({"seed", "plant_rank"})


@contextlib.contextmanager
def _without_local_constants() -> Iterator[None]:
    """Hypothesis's pool of literals from loaded local modules, empty for the duration (its
    cache of permitted constants emptied on the way in and out, so no draw outside sees ours)."""
    try:
        from hypothesis.internal.conjecture import providers

        empty = providers.Constants()
        swap = providers._get_local_constants
        cache = providers.CONSTANTS_CACHE.cache
    except (ImportError, AttributeError):  # a Hypothesis without the pool: nothing to leave out
        yield
        return
    cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = swap
        cache.clear()


def _found(strategy: Any, max_examples: int) -> list[dict[str, Any]]:
    """Every distinct example of ``strategy`` in a derandomized run of ``max_examples``, drawn
    without Hypothesis's local-constant pool (see the module doc)."""
    found: list[dict[str, Any]] = []

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: dict[str, Any]) -> None:
        if example not in found:
            found.append(example)

    with _without_local_constants():
        collect()
    return found


def draw(strategy: Any, count: int) -> list[dict[str, Any]]:
    """``count`` distinct examples of ``strategy``, the same ones on every call."""
    if count <= 0:
        return []
    # Derandomized generation starts from minimal examples (seed 0, size 1, ...), which the
    # edge cases already cover; keep the *last* distinct draws, which vary the most.
    return _found(strategy, max(count * 4, 10))[-count:]


def shape_key(example: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The integer, non-seed parameters of ``example``: what makes its tensors' shapes."""
    return tuple(
        sorted(
            (k, v)
            for k, v in example.items()
            if isinstance(v, int) and not isinstance(v, bool) and k not in _NOT_SHAPE
        )
    )


def _distinct_shapes(
    candidates: list[dict[str, Any]], chosen: list[dict[str, Any]], count: int
) -> list[dict[str, Any]]:
    seen = {shape_key(e) for e in chosen}
    extra = []
    for example in reversed(candidates):  # the later draws vary the most
        key = shape_key(example)
        if key in seen:
            continue
        seen.add(key)
        extra.append(example)
        if len(extra) == count:
            break
    return extra


def examples(case: ParityCase, mode: str) -> list[dict[str, Any]]:
    if mode not in EXAMPLES:
        raise ValueError(f"parity mode must be one of {sorted(EXAMPLES)}, got {mode!r}")
    edge = [dict(e) for e in case.edge_cases]
    quick = edge + [e for e in draw(case.params, EXAMPLES["quick"]) if e not in edge]
    if mode == "quick":
        return quick
    candidates = _found(case.params, EXAMPLES["full"] * 8)
    return quick + _distinct_shapes(candidates, quick, EXAMPLES["full"])
