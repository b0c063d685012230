"""Drawing a case's examples: its edge cases first, then hypothesis-drawn parameter sets.

Drawing happens once in the parent process (deterministically, ``derandomize=True``) so a
multi-rank case sends every rank the same examples, and a run is repeatable.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, given, settings

from parity.case import ParityCase

#: Hypothesis-drawn examples per (case, dtype, parallel size, device) in each mode.
EXAMPLES = {"quick": 2, "full": 12}


def draw(strategy: Any, count: int) -> list[dict[str, Any]]:
    """``count`` distinct examples of ``strategy``, the same ones on every call."""
    if count <= 0:
        return []
    found: list[dict[str, Any]] = []
    # Derandomized generation starts from minimal examples (seed 0, size 1, ...), which the
    # edge cases already cover; keep the *last* distinct draws, which vary the most.

    @settings(
        max_examples=max(count * 4, 10),
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

    collect()
    return found[-count:]


def examples(case: ParityCase, mode: str) -> list[dict[str, Any]]:
    if mode not in EXAMPLES:
        raise ValueError(f"parity mode must be one of {sorted(EXAMPLES)}, got {mode!r}")
    edge = [dict(e) for e in case.edge_cases]
    drawn = [e for e in draw(case.params, EXAMPLES[mode]) if e not in edge]
    return edge + drawn
