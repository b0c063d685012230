"""msprobe's stage-2 "benchmark" standard for fp16/bf16 cells (msprobe 26.2.0's
``precision_standard/standard_config.py``, installed by the ``test`` extra as
``mindstudio-probe``; docs/parity-results.md describes the rules).

On Ascend, msprobe measures the NPU's output and the GPU's output of the same API, both in the
same 16-bit dtype, against one high-precision CPU reference, and judges the *ratios* of their
errors: a 16-bit path may be as inexact as a trusted 16-bit path, not more. Here the trusted
16-bit path (the "benchmark") is the case's reference function -- the stock Megatron path --
run on the CPU in the tested dtype; the path under test is the adaptor's. Both come with a
:class:`~megatron_npu.parity.metrics.TensorComparison` against the upcast reference.

Ratio of a metric = ``|tested| / max(|benchmark|, floor)`` with floor 2**-11 fp16, 2**-8 bf16
(msprobe ``calc_ratio`` / ``_minmum_err``). A ratio above its limit is an error, otherwise pass:

* small-value error share (``small_value_error_share``): 2 at every level;
* max relative error, mean relative error, RMSE: 10 / 2 / 2 (L0), 5 / 1.5 / 1.5 (L1),
  2 / 1.2 / 1.2 (L2). msprobe's levels go by API: L1 for ``npu_fusion_attention``, L2 for
  ``layer_norm`` / ``npu_rms_norm``, cross entropy and GELU; the cases those APIs serve get that
  level (:data:`CASE_LEVELS`), every other case L0.

A metric that is inf/NaN on either side is consistent (ratio NaN, passes) when both are the same
non-finite value, else an error, as msprobe's ``check_inf_or_nan``. The error balance is
reported, not judged (msprobe leaves it out of the status).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from megatron_npu.parity.metrics import TensorComparison, dtype_config, encode_float

from megatron_npu.formats.parity_record import BENCHMARK_LEVELS

__all__ = [
    "against_benchmark",
    "BENCHMARK_PATH",
    "CASE_LEVELS",
    "REL_L2_BENCHMARK_FACTOR",
    "with_benchmark",
    "LEVEL_LIMITS",
    "BenchmarkResult",
    "benchmark_result",
    "level_of",
]

#: what the stage-2 benchmark runs, in words (recorded)
BENCHMARK_PATH = "the case's reference (stock Megatron path) on CPU in the tested dtype"
#: (max relative error, mean relative error, RMSE) ratio limits per msprobe level
LEVEL_LIMITS = dict(
    zip(
        BENCHMARK_LEVELS,  # L0, L1, L2: the levels a parity record may name
        (
            {"max_rel_error": 10.0, "mean_rel_error": 2.0, "rmse": 2.0},
            {"max_rel_error": 5.0, "mean_rel_error": 1.5, "rmse": 1.5},
            {"max_rel_error": 2.0, "mean_rel_error": 1.2, "rmse": 1.2},
        ),
        strict=True,
    )
)
SMALL_VALUE_LIMIT = 2.0
#: parity case name -> msprobe level of the API the case's patch serves
CASE_LEVELS = {"attention": "L1", "norm": "L2", "cross-entropy": "L2", "bias-gelu": "L2"}
JUDGED = ("small_value_error_share", "max_rel_error", "mean_rel_error", "rmse")
REPORTED = (*JUDGED, "error_balance")


#: The relative L2 rule's bound is at least this multiple of the benchmark's own rel_l2 (every
#: dtype), the ratio msprobe allows the max relative error at L0. It only matters for
#: ill-conditioned outputs (a gradient that is a small difference of large terms), where every
#: implementation in the dtype lands far above the dtype's floor and two correct algorithms can
#: differ several-fold (e.g. fp32 RMSNorm's grad with hidden size 1: stock 4.6e-4, kernel 2e-3).
REL_L2_BENCHMARK_FACTOR = 10.0


def with_benchmark(tested: TensorComparison, bench: TensorComparison) -> TensorComparison:
    """``tested`` with ``rel_l2_benchmark`` set and its rel_l2 bound raised to
    ``REL_L2_BENCHMARK_FACTOR`` times the benchmark's rel_l2 when that is larger.

    Where the output is ill-conditioned (a gradient that is a small difference of large terms),
    every path in the dtype has a large relative error and the dtype's fixed bound would fail
    an exact implementation; the benchmark measures that conditioning on the same example.
    """
    if tested.kind != "float" or bench.kind != "float" or bench.rel_l2 is None:
        return tested
    floor = dtype_config(tested.dtype).rel_l2_bound
    bound = max(floor, REL_L2_BENCHMARK_FACTOR * bench.rel_l2)
    return dataclasses.replace(tested, rel_l2_benchmark=bench.rel_l2, rel_l2_bound=bound)


#: the rule dtypes stage 2 judges (fp32 uses its benchmark only to raise the rel_l2 bound)
SIXTEEN_BIT_NAMES = ("float16", "bfloat16")


def against_benchmark(
    tested: TensorComparison, bench: TensorComparison, level: str
) -> tuple[TensorComparison, BenchmarkResult | None]:
    """``tested`` with its benchmark applied (:func:`with_benchmark`) and, for a 16-bit float
    tensor, its stage-2 :func:`benchmark_result` (None otherwise): what the parity harness and
    :func:`megatron_npu.parity.verdict.judge` both judge."""
    if tested.kind != "float" or bench.kind != "float":
        return tested, None
    tested = with_benchmark(tested, bench)
    if tested.dtype not in SIXTEEN_BIT_NAMES:
        return tested, None
    return tested, benchmark_result(tested, bench, level)


def level_of(case_name: str) -> str:
    return CASE_LEVELS.get(case_name, "L0")


@dataclass(frozen=True)
class BenchmarkResult:
    """Stage-2 outcome of one tensor: both sides' metrics, the ratios, limits and status."""

    level: str
    tested: dict[str, float]
    benchmark: dict[str, float]
    ratios: dict[str, float]
    limits: dict[str, float]
    status: str  # pass / error
    reason: str

    def to_dict(self) -> dict[str, Any]:
        enc = lambda d: {k: encode_float(v) for k, v in d.items()}  # noqa: E731
        return {
            "level": self.level,
            "tested": enc(self.tested),
            "benchmark": enc(self.benchmark),
            "ratios": enc(self.ratios),
            "limits": enc(self.limits),
            "verdict": {"status": self.status, "reason": self.reason},
        }


def _ratio(tested: float, bench: float, floor: float) -> tuple[float, bool]:
    """(ratio, consistent) as msprobe: non-finite values must agree and then give NaN."""
    if not (math.isfinite(tested) and math.isfinite(bench)):
        same = (math.isnan(tested) and math.isnan(bench)) or tested == bench
        return math.nan, same
    return abs(tested) / max(abs(bench), floor), True


def benchmark_result(
    tested: TensorComparison, bench: TensorComparison, level: str
) -> BenchmarkResult:
    """Judge ``tested`` (path under test vs reference) against ``bench``
    (benchmark vs reference)."""
    if tested.kind != "float" or bench.kind != "float":
        raise ValueError("the benchmark standard applies to float tensors only")
    if level not in LEVEL_LIMITS:
        raise ValueError(f"benchmark level must be one of {sorted(LEVEL_LIMITS)}, got {level!r}")
    floor = dtype_config(tested.dtype).benchmark_min_err
    limits = {"small_value_error_share": SMALL_VALUE_LIMIT, **LEVEL_LIMITS[level]}
    t = {k: getattr(tested, k) for k in REPORTED}
    b = {k: getattr(bench, k) for k in REPORTED}
    ratios: dict[str, float] = {}
    failures = []
    for key in REPORTED:
        ratio, consistent = _ratio(t[key], b[key], floor)
        ratios[key] = ratio
        if key not in limits:
            continue
        if not consistent:
            failures.append(f"{key} inf/nan differs (tested {t[key]}, benchmark {b[key]})")
        elif not math.isnan(ratio) and ratio > limits[key]:
            failures.append(
                f"{key} ratio {ratio:.4g} > {limits[key]:g} "
                f"(tested {t[key]:.4g}, benchmark {b[key]:.4g})"
            )
    if failures:
        reason = f"benchmark {level}: " + "; ".join(failures)
        status = "error"
    else:
        worst = max(
            (k for k in JUDGED if not math.isnan(ratios[k])),
            key=lambda k: ratios[k] / limits[k],
            default=None,
        )
        detail = f"; worst {worst} ratio {ratios[worst]:.4g} <= {limits[worst]:g}" if worst else ""
        reason = f"benchmark {level}: every ratio within its limit{detail}"
        status = "pass"
    return BenchmarkResult(level, t, b, ratios, limits, status, reason)
