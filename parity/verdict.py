"""pass / warning / error for a :class:`~megatron_npu.parity.metrics.TensorComparison` (msprobe
26.2.0's accuracy-checker rules, see docs/parity-results.md).

Stage 1 (msprobe's accuracy-checker rules, applied in order; the first that decides wins):

1. exact kind (integer / bool): any differing element -> error, else pass.
2. any inf/nan mismatch -> error (added: msprobe only counts such positions as failing in the
   dual-N shares).
3. empty tensor -> pass (msprobe: SKIP).
4. cosine must be > 0.99, else error; not judged for a single element or when NaN (a non-finite
   value present), as in msprobe.
5. relative L2 error above the dtype's bound -> error (added: the relative rule the max-abs
   shortcut cannot bypass; bounds in :mod:`megatron_npu.parity.metrics`).
6. max abs error < 1e-3 -> pass.
7. fp16/bf16: dual hundredth fails -> error; dual thousandth fails -> warning.
   fp32: dual thousandth fails -> error; dual ten-thousandth fails -> warning.
   "dual-N fails" means the share of elements with relative error below N is not > 1 - N.
8. otherwise pass.

Stage 2 (fp16/bf16 cells with a benchmark, :mod:`megatron_npu.parity.benchmark`): when rules 1-5
gave no error, msprobe's "benchmark" standard decides pass or error in place of rules 6-8 (the
max-abs shortcut and the dual-N shares), as msprobe's newer standard replaces its dual-N rules for
float outputs; :func:`final_verdict` combines the two. Rules 6-8 are still computed and quoted in
the reason.

A :class:`Tolerance` override may replace the cosine bound, the relative L2 bound, the abs-error
pass bound and the dual-N levels used at error / warning level, and must carry a written reason;
a verdict reached under an override says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from megatron_npu.parity.benchmark import against_benchmark
from megatron_npu.parity.metrics import DUAL_LEVELS, TensorComparison, compare

from megatron_npu.formats.parity_record import SEVERITY, STATUSES, check_tolerance

__all__ = [
    "COSINE_MIN",
    "ABS_PASS",
    "STATUSES",
    "AccuracyError",
    "judge",
    "require_accurate",
    "Tolerance",
    "Verdict",
    "final_verdict",
    "verdict",
    "worst",
]

COSINE_MIN = 0.99  # cosine must be strictly above
ABS_PASS = 1e-3  # max abs error strictly below passes at once
_SEVERITY = SEVERITY

# (error-level N, warning-level N) per dtype
_DUAL_DEFAULTS = {
    "float16": (DUAL_LEVELS["hundredth"], DUAL_LEVELS["thousandth"]),
    "bfloat16": (DUAL_LEVELS["hundredth"], DUAL_LEVELS["thousandth"]),
    "float32": (DUAL_LEVELS["thousandth"], DUAL_LEVELS["ten_thousandth"]),
}
_LEVEL_NAME = {v: k.replace("_", "-") for k, v in DUAL_LEVELS.items()}
_LEVEL_FIELD = {v: f"dual_{k}" for k, v in DUAL_LEVELS.items()}


@dataclass(frozen=True)
class Tolerance:
    """A per-case loosening (or tightening) of the default thresholds, with its reason.

    ``cosine``: cosine must be > this (default 0.99). ``rel_l2``: relative L2 error must be <=
    this (default: the dtype's bound). ``abs_pass``: max abs error < this passes at once
    (default 1e-3). ``dual_error`` / ``dual_warning``: the N (one of 0.01, 0.001,
    0.0001) of the dual-N check at error / warning level (defaults: fp16/bf16 0.01 / 0.001,
    fp32 0.001 / 0.0001). ``None`` keeps the default.
    """

    reason: str
    cosine: float | None = None
    abs_pass: float | None = None
    dual_error: float | None = None
    dual_warning: float | None = None
    rel_l2: float | None = None

    def __post_init__(self) -> None:
        # the record format's rules: a Tolerance read from a record is checked the same way
        check_tolerance(
            self.reason, self.cosine, self.abs_pass, self.dual_error, self.dual_warning, self.rel_l2
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    """``status`` in pass / warning / error; ``reason`` names the deciding rule and numbers.

    ``rule`` is the deciding rule's id (exact, inf_nan, empty, cosine, rel_l2, max_abs,
    dual_hundredth, dual_thousandth, dual_ten_thousandth, benchmark; crash and timeout for a
    cell that produced no comparison); ``override`` says a Tolerance was in effect.
    """

    status: str
    reason: str
    rule: str
    override: bool = False

    def __post_init__(self) -> None:
        if self.status not in _SEVERITY:
            raise ValueError(f"verdict status must be one of {STATUSES}, got {self.status!r}")

    @property
    def severity(self) -> int:
        return _SEVERITY[self.status]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def verdict(
    comparison: TensorComparison, tolerance: Tolerance | None = None, *, hard_only: bool = False
) -> Verdict | None:
    """Apply the stage-1 rules (module docstring) to one comparison.

    With ``hard_only`` only rules 1-5 run (the ones that stand whatever a benchmark says) and
    None means none of them decided.
    """
    c = comparison
    tol = tolerance
    used = tol is not None

    def make(status: str, reason: str, rule: str, overridden: bool = False) -> Verdict:
        if overridden:
            reason += " (overridden threshold)"
        if used:
            reason += f" [tolerance override: {tol.reason}]"
        return Verdict(status, reason, rule, used)

    if c.kind == "exact":
        if c.exact_mismatch_count:
            return make(
                "error",
                f"{c.exact_mismatch_count} of {c.numel} elements differ (exact comparison)",
                "exact",
            )
        return make("pass", f"all {c.numel} elements equal (exact comparison)", "exact")

    if c.inf_nan_mismatch_count:
        return make("error", f"{c.inf_nan_mismatch_count} inf/nan positions differ", "inf_nan")
    if c.numel == 0:
        return make("pass", "empty tensor: nothing to compare", "empty")

    cos_min = COSINE_MIN if tol is None or tol.cosine is None else tol.cosine
    cos_over = tol is not None and tol.cosine is not None
    assert c.max_abs_error is not None
    if c.cosine is not None and not math.isnan(c.cosine) and not c.cosine > cos_min:
        return make("error", f"cosine {_fmt(c.cosine)} <= {_fmt(cos_min)}", "cosine", cos_over)

    l2_over = tol is not None and tol.rel_l2 is not None
    l2_bound = tol.rel_l2 if l2_over else c.rel_l2_bound
    if c.rel_l2 is not None and l2_bound is not None and not c.rel_l2 <= l2_bound:
        return make(
            "error",
            f"relative L2 error {_fmt(c.rel_l2)} > {_fmt(l2_bound)} ({c.dtype} bound)",
            "rel_l2",
            l2_over,
        )
    if hard_only:
        return None

    abs_pass = ABS_PASS if tol is None or tol.abs_pass is None else tol.abs_pass
    abs_over = tol is not None and tol.abs_pass is not None
    if c.max_abs_error < abs_pass:
        return make(
            "pass", f"max abs error {_fmt(c.max_abs_error)} < {_fmt(abs_pass)}", "max_abs", abs_over
        )

    err_n, warn_n = _DUAL_DEFAULTS[c.dtype]
    err_over = tol is not None and tol.dual_error is not None
    warn_over = tol is not None and tol.dual_warning is not None
    if err_over:
        err_n = tol.dual_error
    if warn_over:
        warn_n = tol.dual_warning

    for n, status, over in ((err_n, "error", err_over), (warn_n, "warning", warn_over)):
        share = getattr(c, _LEVEL_FIELD[n])
        if not share > 1 - n:
            return make(
                status,
                f"dual {_LEVEL_NAME[n]} {_fmt(share)} <= {_fmt(1 - n)} "
                f"(share of relative error < {_fmt(n)})",
                _LEVEL_FIELD[n],
                over,
            )
    share = getattr(c, _LEVEL_FIELD[warn_n])
    return make(
        "pass",
        f"dual {_LEVEL_NAME[warn_n]} {_fmt(share)} > {_fmt(1 - warn_n)}",
        _LEVEL_FIELD[warn_n],
        warn_over,
    )


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most severe verdict (error > warning > pass); the first one among equals.

    Raises ValueError when there is none: a case that compared nothing is a harness bug.
    """
    best: Verdict | None = None
    for v in verdicts:
        if best is None or v.severity > best.severity:
            best = v
    if best is None:
        raise ValueError("worst() needs at least one verdict")
    return best


def final_verdict(
    comparison: TensorComparison, tolerance: Tolerance | None, benchmark: Any = None
) -> Verdict:
    """Stage 1; for a 16-bit tensor with a benchmark, rules 1-5 then stage 2 (module docstring).

    ``benchmark`` is a :class:`megatron_npu.parity.benchmark.BenchmarkResult` or None.
    """
    if benchmark is None:
        return verdict(comparison, tolerance)
    hard = verdict(comparison, tolerance, hard_only=True)
    if hard is not None and (hard.status == "error" or comparison.kind == "exact"):
        return hard
    first = verdict(comparison, tolerance)
    return Verdict(
        benchmark.status,
        f"{benchmark.reason} (stage-1 rules 6-8 would say {first.status}: {first.reason})",
        "benchmark",
        first.override,
    )


class AccuracyError(AssertionError):
    """An output the verdict judged ``error`` (raised by :func:`require_accurate`)."""


def judge(
    actual: Any,
    reference: Any,
    dtype: Any,
    *,
    benchmark: Any = None,
    level: str = "L0",
    tolerance: Tolerance | None = None,
) -> Verdict:
    """The parity harness's verdict of one output tensor, for a check outside the harness.

    ``reference``: the upcast computation (fp32/fp64 for 16-bit, fp64 for fp32);
    ``benchmark``: optionally the stock computation in ``dtype`` (the harness's benchmark),
    which raises the relative L2 bound of an ill-conditioned output and, for 16-bit, makes
    msprobe's stage 2 decide at ``level`` (:mod:`megatron_npu.parity.benchmark`); without one,
    stage 1. The op tests use this, so they and the parity matrix apply one set of rules.
    """
    comparison, result = compare(actual, reference, dtype), None
    if benchmark is not None:
        bench = compare(benchmark, reference, dtype)
        comparison, result = against_benchmark(comparison, bench, level)
    return final_verdict(comparison, tolerance, result)


def require_accurate(
    actual: Any,
    reference: Any,
    dtype: Any,
    what: str = "",
    *,
    benchmark: Any = None,
    level: str = "L0",
    tolerance: Tolerance | None = None,
) -> Verdict:
    """:func:`judge`; raise :class:`AccuracyError` on ``error``. A ``warning`` is returned, not
    raised: it does not fail a parity cell either (msprobe's meaning)."""
    v = judge(actual, reference, dtype, benchmark=benchmark, level=level, tolerance=tolerance)
    if v.status == "error":
        raise AccuracyError(f"{what}: {v.status}: {v.reason} [{v.rule}]")
    return v
