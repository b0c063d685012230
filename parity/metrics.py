"""Accuracy metrics of one output tensor against its reference (msprobe's definitions).

``compare(actual, reference, dtype)`` measures an output computed in ``dtype`` (fp16, bf16 or
fp32: the *rule dtype*, the cell's dtype) against a reference computed on the CPU with the inputs
upcast (fp16/bf16 -> fp32, fp32 -> fp64), as Ascend's msprobe API accuracy checker does
(msprobe 26.2.0's ``api_accuracy_checker/compare/algorithm.py``, from the ``mindstudio-probe``
package of the ``test`` extra; docs/parity-results.md lists the rules). It only measures;
:mod:`megatron_npu.parity.verdict` turns a :class:`TensorComparison` into pass / warning / error.

The stage-1 numbers are computed the way msprobe 26.2.0 computes them (numpy arithmetic in the
same dtypes, so the values are equal, not just close; ``tests/parity/test_msprobe_crosscheck.py``
checks this against msprobe's own functions). ``x`` = actual, ``r`` = reference, as numpy
arrays; a bf16 ``x`` and its reference are both taken to fp32 first (numpy has no bf16).

Departure (named in docs/parity-results.md): every metric is taken over the positions where
both ``x`` and ``r`` (cast to ``x``'s dtype) are finite. msprobe keeps non-finite positions in
its arrays, where they become NaN errors that fail the dual-N shares, make the max abs error NaN
and the cosine NaN. Here a position where both are NaN, or both the same inf, is a *match*
(``nonfinite_match_count``: cases feed inf/nan on purpose to check it propagates), and any other
non-finite position is an ``inf_nan_mismatch_count``, which the verdict makes an error at once.

* ``abs_err = |x - r|`` in numpy's promoted dtype.
* relative error ``abs_err / (|r| + eps)`` with ``eps = finfo(r.dtype).eps`` (2**-23 for an fp32
  reference, 2**-52 for fp64) and ``2**-8`` for bf16 (msprobe's ``BFLOAT16_EPS``).
* ``cosine``: both vectors scaled by their max abs value, then ``x.r / (|x| |r|)`` in float64,
  clipped to [-1, 1]; ``None`` for a single element (not applicable); when a side's max abs
  value is <= ``finfo(float64).eps`` it counts as all zero: both zero -> 1.0, one zero -> 0.0
  (msprobe: blank cell, pass / error).
* ``max_abs_error`` = max of ``abs_err``.
* ``dual_hundredth`` / ``dual_thousandth`` / ``dual_ten_thousandth``: share of elements whose
  relative error is strictly below N = 0.01 / 0.001 / 0.0001.

msprobe's "benchmark" standard numbers (used per side by the stage-2 benchmark rule, see
:mod:`megatron_npu.parity.benchmark`): small values are ``|r| <= T``
(T = 2**-10 fp16/bf16, 2**-20 fp32) at among the compared positions;

* ``max_rel_error`` / ``mean_rel_error``: max / mean of the relative error over the non-small
  positions (0.0 when there are none).
* ``rmse``: ``sqrt(mean(abs_err**2))`` over the same positions (0.0 when none). msprobe
  multiplies the mean square by ``n / (n - k + 1e-4) + 1e-4`` (k masked) instead of dividing by
  the exact count: a departure of about 1e-4 relative, named in docs/parity-results.md.
* ``small_value_error_share``: share of small values with ``abs_err > atol``; 0.0 without
  small values. atol = T * eps for fp16/bf16 (2**-20, 2**-17: a departure from msprobe's
  1e-16, see :data:`SMALL_VALUE_ATOL_NOTE`), msprobe's 2**-30 for fp32.
* ``error_balance``: ``|#(x > r') - #(x < r')| / numel`` with ``r'`` = ``r`` cast to ``x``'s dtype.
* ULP error ``|x - r| * 2**(m - e)`` with m the mantissa width of the rule dtype (10 / 7 / 23)
  and ``e = max(floor(log2 |r|), e_min)`` (e_min -14 fp16, -126 bf16/fp32; ``r == 0`` uses
  ``e = 0``, msprobe's convention), computed in fp32 (fp64 for fp32); over finite positions.
  ``ulp_bad_share``: share above 1 ULP (fp16/bf16) or 32 ULP (fp32).

Added here (not msprobe): ``rel_l2 = ||x - r||_2 / max(||r||_2, sqrt(m) * T)`` over the m
compared positions in float64, T the small-value threshold: where the reference is all small
values, msprobe judges absolute rather than relative error, and so does this (an RMS error in
units of T). It is
the relative rule the max-abs shortcut cannot bypass (see :mod:`megatron_npu.parity.verdict`); its
bound ``rel_l2_bound`` is ``REL_L2_ROUNDINGS[dtype] * u``, raised by
:func:`megatron_npu.parity.benchmark.with_benchmark` to a multiple of what the stock path in the
same dtype reaches (``rel_l2_benchmark``).

Integer and bool tensors are compared for exact equality (``kind == "exact"``); their float
metrics are ``None``. Empty tensors give every share 1.0 and every error 0.0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

from megatron_npu.formats.parity_record import DUAL_LEVEL_NAMES

__all__ = [
    "BF16_REL_EPS",
    "DTYPE_CONFIGS",
    "DtypeConfig",
    "TensorComparison",
    "compare",
    "dtype_config",
    "dtype_name",
    "relative_eps",
]

#: msprobe's ``CompareConst.BFLOAT16_EPS``: the eps of the relative error for bf16 outputs.
BF16_REL_EPS = 2.0**-8
#: msprobe's all-zero threshold of the cosine: a max abs value at or below it is "all zero".
ZERO_THRESHOLD = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class DtypeConfig:
    """Per-dtype constants of the rules."""

    name: str
    small_value: float  # |r| <= small_value is a small value (msprobe StandardConfig)
    small_value_atol: float  # benchmark standard: a small value with abs error above is bad
    benchmark_min_err: float  # floor of a benchmark ratio's denominator (msprobe _minmum_err)
    mantissa_bits: int
    ulp_min_exponent: int  # msprobe ULP_PARAMETERS min_eb
    ulp_bad_bound: float  # more ULP than this is a bad element
    unit_roundoff: float  # u = finfo(dtype).eps / 2: the relative error of one rounding
    rel_l2_bound: float  # rel_l2 above this is an error (megatron_npu.parity.verdict)
    reference_dtypes: tuple[torch.dtype, ...]  # acceptable reference precisions


#: rel_l2 may reach this many unit roundoffs u of the dtype (the floor of the rule's bound).
#: One correctly rounded result has rel_l2 <= u (about u / sqrt(3) on average). fp16/bf16 paths
#: compute in fp32 and round the output once or a few times, so 8 u covers them (3.9e-3 fp16,
#: 3.1e-2 bf16, where the stage-2 benchmark judges more finely). An fp32 path's own
#: arithmetic dominates instead: reductions over up to 4096 terms grow a random-walk error of
#: about sqrt(4096) = 64 u (3.8e-6). Both lie far below the 1.3e-2 of a 6 % error on 5 % of
#: the elements and the 1.0 of a doubled gradient.
REL_L2_ROUNDINGS = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 64}


def _config(dtype: torch.dtype, **kw: Any) -> DtypeConfig:
    u = torch.finfo(dtype).eps / 2
    return DtypeConfig(
        name=dtype_name(dtype),
        unit_roundoff=u,
        rel_l2_bound=REL_L2_ROUNDINGS[dtype] * u,
        **kw,
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


DTYPE_CONFIGS: dict[torch.dtype, DtypeConfig] = {
    torch.float16: _config(
        torch.float16,
        small_value=2.0**-10,
        small_value_atol=2.0**-10 * 2.0**-10,  # msprobe: 1e-16 (see SMALL_VALUE_ATOL_NOTE)
        benchmark_min_err=2.0**-11,
        mantissa_bits=10,
        ulp_min_exponent=-14,
        ulp_bad_bound=1.0,
        reference_dtypes=(torch.float32, torch.float64),
    ),
    torch.bfloat16: _config(
        torch.bfloat16,
        small_value=2.0**-10,
        small_value_atol=2.0**-10 * 2.0**-7,  # msprobe: 1e-16 (see SMALL_VALUE_ATOL_NOTE)
        benchmark_min_err=2.0**-8,
        mantissa_bits=7,
        ulp_min_exponent=-126,
        ulp_bad_bound=1.0,
        reference_dtypes=(torch.float32, torch.float64),
    ),
    torch.float32: _config(
        torch.float32,
        small_value=2.0**-20,
        small_value_atol=2.0**-30,  # msprobe's (larger than T * eps = 2**-43)
        benchmark_min_err=2.0**-14,
        mantissa_bits=23,
        ulp_min_exponent=-126,
        ulp_bad_bound=32.0,
        reference_dtypes=(torch.float64,),
    ),
}

#: Departure from msprobe (fp16/bf16 only): a small value (|r| <= T) counts as wrong when its
#: abs error exceeds T * eps (eps = finfo(dtype).eps: the dtype's spacing at T, i.e. what two
#: roundings of half a spacing each can add up to -- a 16-bit path rounds an intermediate and
#: its output), not msprobe's benchmark atol of 1e-16 (fp32 keeps msprobe's 2**-30, already
#: larger than T * eps there). With 1e-16 any 16-bit rounding of a non-zero small value is
#: "wrong", so the share only says how many exact zeros a path hits, and an fp32-internal path
#: that leaves 1e-7 where the stock 16-bit path has an exact zero fails the ratio limit of 2
#: though both are far inside the dtype's resolution; and with a benchmark share of 0 the ratio
#: floor (2**-11 for fp16) turns a single element one spacing off among a thousand small values
#: into an error.
SMALL_VALUE_ATOL_NOTE = "fp16/bf16 small-value atol = T * eps (msprobe: 1e-16)"

_NAME_TO_DTYPE = {cfg.name: dt for dt, cfg in DTYPE_CONFIGS.items()}

DUAL_LEVELS = DUAL_LEVEL_NAMES  # the record format's names, one definition


def dtype_config(dtype: torch.dtype | str) -> DtypeConfig:
    """The constants for fp16 / bf16 / fp32 (a dtype or its name); ValueError for others."""
    if isinstance(dtype, str):
        if dtype not in _NAME_TO_DTYPE:
            raise ValueError(
                f"unsupported parity dtype {dtype!r}; expected one of {sorted(_NAME_TO_DTYPE)}"
            )
        dtype = _NAME_TO_DTYPE[dtype]
    try:
        return DTYPE_CONFIGS[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported parity dtype {dtype}; expected one of {sorted(_NAME_TO_DTYPE)}"
        ) from None


def relative_eps(cfg: DtypeConfig, reference_dtype: torch.dtype) -> float:
    """eps of the relative error: 2**-8 for bf16, else ``finfo(reference dtype).eps``."""
    if cfg.name == "bfloat16":
        return BF16_REL_EPS
    return torch.finfo(reference_dtype).eps


@dataclass(frozen=True)
class TensorComparison:
    """Metrics of one output tensor; ``None`` where a metric does not apply (exact kind)."""

    kind: str  # "float" (msprobe metrics) or "exact" (integer / bool equality)
    dtype: str  # the dtype the rules use, e.g. "bfloat16"
    actual_dtype: str
    reference_dtype: str
    actual_shape: tuple[int, ...]
    reference_shape: tuple[int, ...]
    numel: int
    compared_count: int  # positions where both are finite
    nonfinite_match_count: int  # positions where both are NaN or the same inf
    inf_nan_mismatch_count: int
    exact_mismatch_count: int | None  # exact kind: elements that differ
    cosine: float | None
    max_abs_error: float | None
    max_rel_error: float | None
    mean_rel_error: float | None
    rel_eps: float | None
    dual_hundredth: float | None
    dual_thousandth: float | None
    dual_ten_thousandth: float | None
    rmse: float | None
    error_balance: float | None
    small_value_threshold: float | None
    small_value_count: int | None
    small_value_error_share: float | None
    ulp_max: float | None
    ulp_mean: float | None
    ulp_bad_bound: float | None
    ulp_bad_share: float | None
    # schema 2
    rel_l2: float | None = None
    rel_l2_bound: float | None = None
    small_value_atol: float | None = None
    rel_l2_benchmark: float | None = None  # the benchmark path's rel_l2, when one ran

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: shapes as lists, non-finite floats as "Infinity"/"-Infinity"/"NaN"."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, float):
                value = encode_float(value)
            out[key] = value
        return out


def encode_float(value: float) -> float | str:
    """Finite floats as is; inf / nan as strings so the JSON stays strict."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _is_exact_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def compare(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> TensorComparison:
    """Measure ``actual`` (computed in ``dtype``) against ``reference``.

    ``dtype`` selects the rule constants (eps, small-value threshold, ULP width); ``actual`` may
    be stored in another float dtype (e.g. an fp32 ``rstd`` output of a bf16 op). ``reference``
    must be at least the upcast precision: fp32 or fp64 for fp16/bf16, fp64 for fp32 -- except
    for the stage-2 benchmark, which measures a 16-bit benchmark run against the same upcast
    reference through this function too.

    Raises ValueError for different shapes (naming both), an unsupported ``dtype``, a reference
    below the upcast precision, complex tensors, or one float and one integer tensor.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(reference, torch.Tensor):
        raise TypeError(
            f"compare() takes tensors, got {type(actual).__name__} and {type(reference).__name__}"
        )
    if tuple(actual.shape) != tuple(reference.shape):
        raise ValueError(
            f"shape mismatch: actual {tuple(actual.shape)} vs reference {tuple(reference.shape)}"
        )
    cfg = dtype_config(dtype)
    if actual.dtype.is_complex or reference.dtype.is_complex:
        raise ValueError("complex tensors are not supported by the parity metrics")

    actual = actual.detach().cpu()
    reference = reference.detach().cpu()
    common = {
        "dtype": cfg.name,
        "actual_dtype": dtype_name(actual.dtype),
        "reference_dtype": dtype_name(reference.dtype),
        "actual_shape": tuple(actual.shape),
        "reference_shape": tuple(reference.shape),
        "numel": actual.numel(),
    }

    exact_a, exact_r = _is_exact_dtype(actual.dtype), _is_exact_dtype(reference.dtype)
    if exact_a or exact_r:
        if not (exact_a and exact_r):
            raise ValueError(
                f"cannot compare {dtype_name(actual.dtype)} actual with "
                f"{dtype_name(reference.dtype)} reference: one is integer/bool, the other float"
            )
        return _compare_exact(actual, reference, common)

    if reference.dtype not in cfg.reference_dtypes:
        allowed = " or ".join(dtype_name(d) for d in cfg.reference_dtypes)
        raise ValueError(
            f"a {cfg.name} output needs a {allowed} reference (inputs upcast), "
            f"got {dtype_name(reference.dtype)}"
        )
    return _compare_float(actual, reference, cfg, common)


def _compare_exact(
    actual: torch.Tensor, reference: torch.Tensor, common: dict[str, Any]
) -> TensorComparison:
    differ = actual != reference  # type promotion: a bool against an integer uses True == 1
    n = actual.numel()
    nones = {f.name: None for f in fields(TensorComparison) if f.name not in _EXACT_SET}
    return TensorComparison(
        kind="exact",
        **common,
        compared_count=n,
        nonfinite_match_count=0,
        inf_nan_mismatch_count=0,
        exact_mismatch_count=int(differ.sum()),
        **nones,
    )


_EXACT_SET = {
    "kind",
    "dtype",
    "actual_dtype",
    "reference_dtype",
    "actual_shape",
    "reference_shape",
    "numel",
    "compared_count",
    "nonfinite_match_count",
    "inf_nan_mismatch_count",
    "exact_mismatch_count",
}


def as_numpy(actual: torch.Tensor, reference: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Both tensors flattened as numpy arrays the way msprobe prepares them: a bf16 actual
    takes itself and its reference to fp32 (numpy has no bf16)."""
    if actual.dtype == torch.bfloat16:
        actual, reference = actual.float(), reference.float()
    return actual.reshape(-1).numpy(), reference.reshape(-1).numpy()


def cosine(x: np.ndarray, r: np.ndarray) -> float | None:
    """msprobe's cosine (module docstring); None for a single element."""
    if x.size == 1:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        x_max = np.max(np.abs(x)) if x.size else 0.0
        r_max = np.max(np.abs(r)) if r.size else 0.0
        x_zero, r_zero = x_max <= ZERO_THRESHOLD, r_max <= ZERO_THRESHOLD
        if x_zero and r_zero:
            return 1.0
        if x_zero or r_zero:
            return 0.0
        xs = x.astype(np.float64) / x_max
        rs = r.astype(np.float64) / r_max
        cos = np.dot(xs, rs) / (np.linalg.norm(xs) * np.linalg.norm(rs))
    if np.isnan(cos):
        return math.nan
    return float(np.clip(cos, -1, 1))


def _share_below(rel: np.ndarray, level: float) -> float:
    return float(np.sum(rel < level) / rel.size) if rel.size else 1.0


def _compare_float(
    actual: torch.Tensor, reference: torch.Tensor, cfg: DtypeConfig, common: dict[str, Any]
) -> TensorComparison:
    x_all, r_all = as_numpy(actual, reference)
    with np.errstate(invalid="ignore", over="ignore"):
        r_as_x = r_all.astype(x_all.dtype)
    finite = np.isfinite(x_all) & np.isfinite(r_as_x)
    nonfinite_match = (np.isnan(x_all) & np.isnan(r_as_x)) | (
        np.isinf(x_all) & np.isinf(r_as_x) & (x_all == r_as_x)
    )
    mismatch = ~finite & ~nonfinite_match
    x, r = x_all[finite], r_all[finite]
    n = x.size
    eps = relative_eps(cfg, torch.from_numpy(r[:0]).dtype)
    abs_err = np.abs(x - r)
    abs_ref = np.abs(r)
    rel = abs_err / (abs_ref + (r.dtype.type(eps) if cfg.name != "bfloat16" else eps))

    small = abs_ref <= cfg.small_value
    rel_normal = rel[~small]
    err_normal = abs_err[~small]
    small_count = int(small.sum())
    small_bad = int((small & (abs_err > cfg.small_value_atol)).sum())
    above = int(np.sum((x - r.astype(x.dtype)) > 0))
    below = int(np.sum((x - r.astype(x.dtype)) < 0))

    # ULP (msprobe get_ulp_err)
    ulp_dt = np.float64 if cfg.name == "float32" else np.float32
    safe = np.where(abs_ref == 0, 1, abs_ref)
    eb = np.maximum(np.where(abs_ref == 0, 0, np.floor(np.log2(safe))), cfg.ulp_min_exponent)
    ulp = np.abs(
        (x.astype(ulp_dt) - r).astype(ulp_dt) * np.exp2(-eb + cfg.mantissa_bits).astype(ulp_dt)
    )

    # relative L2 (added rule), float64
    denom = max(float(np.linalg.norm(r.astype(np.float64))), math.sqrt(n) * cfg.small_value)
    diff = x.astype(np.float64) - r.astype(np.float64)
    rel_l2 = float(np.linalg.norm(diff)) / denom if n else 0.0

    return TensorComparison(
        kind="float",
        **common,
        compared_count=n,
        nonfinite_match_count=int(nonfinite_match.sum()),
        inf_nan_mismatch_count=int(mismatch.sum()),
        exact_mismatch_count=None,
        cosine=cosine(x, r) if n else 1.0,
        max_abs_error=float(np.max(abs_err)) if n else 0.0,
        max_rel_error=float(np.max(rel_normal)) if rel_normal.size else 0.0,
        mean_rel_error=float(np.mean(rel_normal)) if rel_normal.size else 0.0,
        rel_eps=float(eps),
        dual_hundredth=_share_below(rel, DUAL_LEVELS["hundredth"]),
        dual_thousandth=_share_below(rel, DUAL_LEVELS["thousandth"]),
        dual_ten_thousandth=_share_below(rel, DUAL_LEVELS["ten_thousandth"]),
        rmse=float(np.sqrt(np.mean(np.square(err_normal)))) if err_normal.size else 0.0,
        error_balance=abs(above - below) / x_all.size if x_all.size else 0.0,
        small_value_threshold=cfg.small_value,
        small_value_count=small_count,
        small_value_error_share=small_bad / small_count if small_count else 0.0,
        ulp_max=float(np.max(ulp)) if n else 0.0,
        ulp_mean=float(np.mean(ulp)) if n else 0.0,
        ulp_bad_bound=cfg.ulp_bad_bound,
        ulp_bad_share=float(np.sum(ulp > cfg.ulp_bad_bound) / n) if n else 0.0,
        rel_l2=rel_l2,
        rel_l2_bound=cfg.rel_l2_bound,
        small_value_atol=cfg.small_value_atol,
    )
