"""Delta debugging over the adaptor's patches: which one makes the divergent module diverge.

``fixed(disabled)`` replays the step with the patches in ``disabled`` switched off (the
adaptor's own switch, ``apply(disable=...)``) and says whether the divergent module is back
within tolerance. :func:`search` first checks that switching off the whole candidate set fixes
the module (otherwise the culprit is not among them and the next, wider set is tried), then
narrows it with Zeller's ``ddmin`` (a replay that fails -- some patches cannot be switched off
together, e.g. the device plumbing the optimizer step needs -- counts as "not fixed"; when the
whole set cannot be switched off, each half is tried instead): split the set into ``n`` parts, keep
a part (or the complement of a part) whose removal still fixes the module, and refine until no
single patch can be dropped. The result is one patch, or a minimal set of patches that only together
explain the divergence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trial:
    disabled: list[str]
    fixed: bool | None  # None: the replay failed
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"disabled": self.disabled, "fixed": self.fixed, "detail": self.detail}


@dataclass
class Search:
    culprits: list[str]  # empty: not found
    candidate_sets: list[list[str]]
    trials: list[Trial] = field(default_factory=list)
    note: str = ""
    #: nothing fixed: the narrowest set tried whose switching-off could not even be replayed
    #: (the patches Megatron cannot run without in this configuration)
    suspects: list[str] = field(default_factory=list)
    #: the torch_npu kernels whose native service fixed the module (the culprits call them)
    kernels: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "culprits": self.culprits,
            "kernels": self.kernels,
            "suspects": self.suspects,
            "candidate_sets": self.candidate_sets,
            "trials": [t.as_dict() for t in self.trials],
            "note": self.note,
        }


class _OutOfTrials(Exception):
    pass


def _split(items: list[str], n: int) -> list[list[str]]:
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return [p for p in parts if p]


def ddmin(items: Sequence[str], fixed: Callable[[list[str]], bool]) -> list[str]:
    """A 1-minimal subset of ``items`` whose disabling still fixes (``fixed(items)`` is True)."""
    current = list(items)
    n = 2
    while len(current) >= 2:
        parts = _split(current, n)
        for part in parts:
            if fixed(part):
                current, n = part, 2
                break
        else:
            for part in parts:
                complement = [x for x in current if x not in part]
                if len(parts) > 2 and complement and fixed(complement):
                    current, n = complement, max(n - 1, 2)
                    break
            else:
                if n >= len(current):
                    break
                n = min(len(current), 2 * n)
    return current


def search(
    candidate_sets: Sequence[Sequence[str]],
    replay: Callable[[list[str]], tuple[bool | None, str]],
    max_trials: int = 16,
) -> Search:
    """Try each candidate set in turn (narrowest first); ddmin inside the first that fixes.
    At most ``max_trials`` replays."""
    result = Search([], [list(s) for s in candidate_sets])
    done: dict[tuple[str, ...], Trial] = {}

    def attempt(disabled: list[str]) -> bool | None:
        """True: fixed; False: still divergent; None: the replay failed."""
        key = tuple(sorted(disabled))
        if key not in done:
            if len(done) >= max_trials:
                raise _OutOfTrials
            ok, detail = replay(sorted(disabled))
            done[key] = Trial(sorted(disabled), ok, detail)
            result.trials.append(done[key])
        return done[key].fixed

    def fixed(disabled: list[str]) -> bool:
        return bool(attempt(disabled))

    def narrow(candidates: list[str]) -> list[str] | None:
        """ddmin inside ``candidates`` if switching them all off fixes; when the replay fails
        (some patches cannot be switched off together, e.g. the device plumbing the optimizer
        needs), look in each half instead."""
        state = attempt(candidates)
        if state:
            return ddmin(sorted(candidates), fixed)
        if state is None and len(candidates) > 1:
            for part in _split(sorted(candidates), 2):
                found = narrow(part)
                if found:
                    return found
        return None

    tried: set[tuple[str, ...]] = set()
    try:
        for candidates in candidate_sets:
            key = tuple(sorted(candidates))
            if not candidates or key in tried:
                continue
            tried.add(key)
            found = narrow(list(candidates))
            if found:
                result.culprits = found
                return result
        result.note = (
            "switching off the patches the module reaches does not bring it back within "
            "tolerance: the divergence is not caused by one of the adaptor's patches (or needs "
            "patches the module does not reach)"
        )
    except _OutOfTrials:
        result.note = f"stopped after {max_trials} replays without a patch whose removal fixes"
    failed = [t for t in result.trials if t.fixed is None]
    if failed:
        result.suspects = min(failed, key=lambda t: len(t.disabled)).disabled
        result.note += (
            f"; switching off {', '.join(result.suspects)} could not be replayed (Megatron cannot "
            "run this configuration without them): suspects"
        )
    return result
