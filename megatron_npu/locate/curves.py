"""The first divergent step, from two runs' loss and grad-norm curves.

The error is the ``approximate`` rule's relative error ``|c - r| / |r|``
(:func:`megatron_npu.compare.rules.relative_errors`, one implementation), searched coarse to
fine (:data:`STAGES`): the first divergent step is the first step whose loss *or* grad norm is
beyond 5 %; when no step is, the first beyond 2 %, and then the first beyond ``floor`` (1e-4:
well above what two healthy fp32 paths differ by on the first steps, 1e-6). ``None``: the curves
agree within ``floor`` at every step. The approximate rule's own verdict on the pair (its
defaults: 2 % per step, 1 % mean, grad norm 10 %) is recorded beside the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_npu.compare import rules
from megatron_npu.formats import FormatError
from megatron_npu.formats.locate_curve import LocateCurve
from megatron_npu.formats.metrics import MetricsFile, StepRecord

#: the last resort: a step whose error exceeds this is divergent
FLOOR = 1e-4
#: the search's first two stages: a step clearly off (5 %, Megatron's golden-value figure), then
#: one off by more than the loosest mean the field allows (2 %); coarse to fine, so that the
#: replayed step shows the bug plainly (any pair compare fails has a step beyond the floor)
STAGES = (0.05, 0.02)


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
        return {
            "step": self.step,
            "quantity": self.quantity,
            "rel_error": self.rel_error,
            "threshold": self.threshold,
            "approximate": self.approximate,
        }


@dataclass(frozen=True)
class Record:
    """A run's curve and the absolute rounding per quantity its values carry (a Megatron-LM
    log's printed digits, :data:`megatron_npu.compare.mlm_log.PRINTED_RESOLUTION`)."""

    curve: rules.Curve
    resolution: dict[str, float]


def read_record(path: str | Path) -> Record:
    """A run's record from a locate curve file, or from anything compare imports as a run
    (:func:`megatron_npu.compare.imports.load`): train's ``metrics.json``, a Megatron-LM log, or
    its TensorBoard event folder -- the runs a user already has. Read once."""
    from megatron_npu.compare import imports, mlm_log

    path = Path(path)
    if not path.exists():
        raise CurveError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CurveError(f"{path}: cannot read ({exc.strerror})") from None
        except ValueError as exc:
            raise CurveError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and "iterations" in data:
            try:
                found = LocateCurve.parse(data, str(path))
            except FormatError as exc:
                raise CurveError(f"not a locate curve: {exc}") from None
            curve = rules.Curve(
                found.iterations, found.losses, found.grad_norms, [0.0] * len(found.iterations)
            )
            return Record(curve, {})
        if not isinstance(data, dict) or "steps" not in data:
            raise CurveError(f"{path}: neither a locate curve nor a metrics.json with 'steps'")
        try:
            return Record(_from_steps(MetricsFile.parse(data, str(path)).steps), {})
        except FormatError as exc:
            raise CurveError(f"not a metrics.json: {exc}") from None
    try:
        imported = imports.load(path)
    except imports.ImportedRunError as exc:
        raise CurveError(
            f"neither a locate curve nor a run compare imports (metrics.json, Megatron-LM log, "
            f"TensorBoard folder): {exc}"
        ) from None
    logged = imported.provenance.get("kind") == "megatron-lm-log"
    return Record(
        _from_steps(imported.metrics.steps), dict(mlm_log.PRINTED_RESOLUTION) if logged else {}
    )


def read_curve(path: str | Path) -> rules.Curve:
    """The curve of :func:`read_record`."""
    return read_record(path).curve


def printed_resolution(path: str | Path) -> dict[str, float]:
    """The rounding of :func:`read_record` (none for what cannot be read)."""
    try:
        return read_record(path).resolution
    except CurveError:
        return {}


def _from_steps(steps: list[StepRecord]) -> rules.Curve:
    """A curve from the ``steps`` records of a metrics document."""
    return rules.Curve(
        [s.step for s in steps],
        [s.lm_loss for s in steps],
        [s.grad_norm for s in steps],
        [float(s.step_time_s or 0.0) for s in steps],
    )


def _errors(ref: list, cand: list, rounding: float = 0.0) -> list[float | None]:
    """Relative errors; a difference within both values' printed ``rounding`` is none."""
    out: list[float | None] = []
    for r, c in zip(ref, cand, strict=True):
        if r is None or c is None:
            out.append(None)
        elif abs(c - r) <= 2 * rounding * (1 + 1e-9):  # one printed unit apart at most
            out.append(0.0)
        else:
            out.append(float(rules.relative_errors([r], [c])[0]))
    return out


def first_divergent_step(
    ref: rules.Curve,
    cand: rules.Curve,
    *,
    rtol: float = STAGES[0],
    mean_rtol: float = STAGES[1],
    floor: float = FLOOR,
    resolution: dict[str, float] | None = None,
) -> StepFinding:
    """``resolution``: absolute rounding per quantity the curves' values carry (logged digits,
    :func:`printed_resolution`); differences within it are not errors."""
    resolution = resolution or {}
    verdict = rules.approximate("candidate", "reference", ref, cand)
    approx = {"status": verdict.status, "detail": verdict.detail, "tolerance": verdict.tolerance}
    if ref.iterations != cand.iterations:
        raise CurveError(
            f"the runs have different steps ({ref.iterations[:1]}..{ref.iterations[-1:]} vs "
            f"{cand.iterations[:1]}..{cand.iterations[-1:]})"
        )
    series = {
        "loss": _errors(ref.losses, cand.losses, resolution.get("loss", 0.0)),
        "grad_norm": _errors(ref.grad_norms, cand.grad_norms, resolution.get("grad_norm", 0.0)),
    }
    for threshold in (rtol, mean_rtol, floor):
        for index, step in enumerate(ref.iterations):
            for quantity in ("loss", "grad_norm"):
                err = series[quantity][index]
                if err is not None and err > threshold:
                    return StepFinding(step, quantity, err, threshold, approx)
    return StepFinding(None, None, None, None, approx)
