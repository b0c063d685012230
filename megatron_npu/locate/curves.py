"""The first divergent step, from two runs' loss and grad-norm curves.

The tolerance is the ``approximate`` rule's (:func:`megatron_npu.compare.rules.approximate`,
relative error ``|c - r| / |r|``, one implementation): the first divergent step is the first
step whose loss *or* grad norm is beyond ``rtol`` (5 %). When no step is (a small error that the
rule fails on its mean or its late trend), it is the first step beyond ``mean_rtol`` (2 %), and
then the first beyond ``floor`` (1e-4: well above what two healthy fp32 paths differ by on the
first steps, 1e-6). ``None``: the curves agree within ``floor`` at every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_npu.compare import rules

#: the last resort: a step whose error exceeds this is divergent
FLOOR = 1e-4


class CurveError(ValueError):
    """A curve file is missing, unreadable or not a run's per-step record."""


@dataclass(frozen=True)
class StepFinding:
    step: int | None
    quantity: str | None  # "loss" or "grad_norm"
    rel_error: float | None
    threshold: float | None
    approximate: dict[str, Any]  # the approximate rule's verdict on the pair

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "quantity": self.quantity, "rel_error": self.rel_error,
                "threshold": self.threshold, "approximate": self.approximate}  # fmt: skip


def read_curve(path: str | Path) -> rules.Curve:
    """A curve from a worker's curve file or train's ``metrics.json`` (``steps`` records)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CurveError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise CurveError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "iterations" in data:
        return rules.Curve(list(data["iterations"]), list(data["losses"]),
                           list(data["grad_norms"]), [0.0] * len(data["iterations"]))  # fmt: skip
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise CurveError(f"{path}: neither a locate curve nor a metrics.json with 'steps'")
    return rules.Curve(
        [int(s["step"]) for s in steps], [s.get("lm_loss") for s in steps],
        [s.get("grad_norm") for s in steps], [float(s.get("step_time_s") or 0.0) for s in steps],
    )  # fmt: skip


def _errors(ref: list, cand: list) -> list[float | None]:
    out: list[float | None] = []
    for r, c in zip(ref, cand):
        out.append(None if r is None or c is None else float(rules.relative_errors([r], [c])[0]))
    return out


def first_divergent_step(ref: rules.Curve, cand: rules.Curve, *, rtol: float = 0.05,
                         mean_rtol: float = 0.02, floor: float = FLOOR) -> StepFinding:  # fmt: skip
    verdict = rules.approximate("candidate", "reference", ref, cand, rtol=rtol, mean_rtol=mean_rtol)
    approx = {"status": verdict.status, "detail": verdict.detail, "tolerance": verdict.tolerance}
    if ref.iterations != cand.iterations:
        raise CurveError(
            f"the runs have different steps ({ref.iterations[:1]}..{ref.iterations[-1:]} vs "
            f"{cand.iterations[:1]}..{cand.iterations[-1:]})"
        )
    series = {
        "loss": _errors(ref.losses, cand.losses),
        "grad_norm": _errors(ref.grad_norms, cand.grad_norms),
    }
    for threshold in (rtol, mean_rtol, floor):
        for index, step in enumerate(ref.iterations):
            for quantity in ("loss", "grad_norm"):
                err = series[quantity][index]
                if err is not None and err > threshold:
                    return StepFinding(step, quantity, err, threshold, approx)
    return StepFinding(None, None, None, None, approx)
