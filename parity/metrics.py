"""Accuracy metrics of one output tensor against its CPU reference (msprobe conventions).

``compare(actual, reference, dtype)`` measures an output computed in ``dtype`` (fp16, bf16 or
fp32) against a reference computed on the CPU with the inputs upcast (fp16/bf16 -> fp32,
fp32 -> fp64), as the Ascend msprobe API accuracy checker does (REFERENCE.md section 3). It only
measures; :mod:`parity.verdict` turns a :class:`TensorComparison` into pass / warning / error.

Definitions (``x`` = actual, ``r`` = reference, both taken to float64, over the *compared*
elements, i.e. the positions where both are finite):

* ``cosine``: ``x.r / (|x| |r|)``, clamped to [-1, 1]; both vectors zero (or no compared
  elements) -> 1.0, exactly one of them zero -> 0.0.
* ``max_abs_error``: ``max |x - r|``.
* relative error ``|x - r| / (|r| + eps)`` with ``eps`` the unit roundoff of ``dtype``,
  ``torch.finfo(dtype).eps / 2``: fp16 2**-11, bf16 2**-8 (the value REFERENCE.md gives),
  fp32 2**-24. ``max_rel_error`` / ``mean_rel_error`` are its max and mean.
* ``dual_hundredth`` / ``dual_thousandth`` / ``dual_ten_thousandth``: share of elements whose
  relative error is below N = 0.01 / 0.001 / 0.0001 (strictly). The rule (in the verdict) asks
  for a share > 1 - N.
* ``rmse``: ``sqrt(mean((x - r)**2))``.
* ``error_balance``: ``|#(x > r') - #(x < r')| / n`` where ``r'`` is the reference rounded to
  the dtype ``actual`` is stored in (msprobe's convention: an exactly rounded result is neither
  above nor below) and n is the number of compared elements.
* small values: elements with ``|r| <= T``, T = 2**-10 for fp16/bf16 and 2**-20 for fp32.
  ``small_value_error_share`` = #(small and ``|x - r| > T``) / #small, 0.0 when there are none.
* ULP error: ``|x - r| / 2**(e - m)`` where m is the mantissa width of ``dtype`` (10 fp16,
  7 bf16, 23 fp32) and ``e = floor(log2 |r|)`` clamped to the normal exponent range of
  ``dtype`` (fp16 [-14, 15], bf16/fp32 [-126, 127]; ``r == 0`` uses the minimum, i.e. the
  subnormal spacing). ``ulp_bad_share`` is the share of elements above the bound: 1 ULP for
  fp16/bf16, 32 ULP for fp32.
* non-finite values: ``r`` is first rounded to the dtype ``actual`` is stored in (a reference
  that overflows it counts as inf). A position where both are NaN, or both are inf of the same
  sign, is a *match* and is left out of every numeric metric. Any other position where either is
  non-finite is an ``inf_nan_mismatch`` (the verdict makes it an error); it is left out of the
  numeric metrics too.

Integer and bool tensors are compared for exact equality (``kind == "exact"``); their float
metrics are ``None``. Empty tensors give a comparison with every share 1.0 and every error 0.0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

__all__ = [
    "DTYPE_CONFIGS",
    "DtypeConfig",
    "TensorComparison",
    "compare",
    "dtype_config",
    "dtype_name",
]


@dataclass(frozen=True)
class DtypeConfig:
    """Per-dtype constants of the msprobe rules."""

    name: str
    rel_eps: float  # eps in |x - r| / (|r| + eps)
    small_value: float  # |r| <= small_value is a small value; its abs error must not exceed it
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal number
    max_exponent: int  # exponent of the largest finite number
    ulp_bad_bound: float  # more ULP than this is a bad element
    reference_dtypes: tuple[torch.dtype, ...]  # acceptable reference precisions


DTYPE_CONFIGS: dict[torch.dtype, DtypeConfig] = {
    torch.float16: DtypeConfig(
        name="float16",
        rel_eps=torch.finfo(torch.float16).eps / 2,  # 2**-11
        small_value=2.0**-10,
        mantissa_bits=10,
        min_exponent=-14,
        max_exponent=15,
        ulp_bad_bound=1.0,
        reference_dtypes=(torch.float32, torch.float64),
    ),
    torch.bfloat16: DtypeConfig(
        name="bfloat16",
        rel_eps=torch.finfo(torch.bfloat16).eps / 2,  # 2**-8
        small_value=2.0**-10,
        mantissa_bits=7,
        min_exponent=-126,
        max_exponent=127,
        ulp_bad_bound=1.0,
        reference_dtypes=(torch.float32, torch.float64),
    ),
    torch.float32: DtypeConfig(
        name="float32",
        rel_eps=torch.finfo(torch.float32).eps / 2,  # 2**-24
        small_value=2.0**-20,
        mantissa_bits=23,
        min_exponent=-126,
        max_exponent=127,
        ulp_bad_bound=32.0,
        reference_dtypes=(torch.float64,),
    ),
}

_NAME_TO_DTYPE = {cfg.name: dt for dt, cfg in DTYPE_CONFIGS.items()}

DUAL_LEVELS = {"hundredth": 1e-2, "thousandth": 1e-3, "ten_thousandth": 1e-4}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


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
    compared_count: int  # elements that enter the numeric metrics
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorComparison:
        """Inverse of :meth:`to_dict`; KeyError names a missing field, ValueError a bad one."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                raise KeyError(f.name)
            value = data[f.name]
            if f.name in ("actual_shape", "reference_shape"):
                if not isinstance(value, list) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in value
                ):
                    raise ValueError(f"{f.name} must be a list of ints, got {value!r}")
                value = tuple(value)
            elif f.name in _STR_FIELDS:
                if not isinstance(value, str):
                    raise ValueError(f"{f.name} must be a string, got {value!r}")
            elif f.name in _INT_FIELDS:
                if value is None and f.name in _OPTIONAL_INT_FIELDS:
                    pass
                elif not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{f.name} must be an int, got {value!r}")
            else:
                value = decode_float(value, f.name)
            kwargs[f.name] = value
        if kwargs["kind"] not in ("float", "exact"):
            raise ValueError(f"kind must be 'float' or 'exact', got {kwargs['kind']!r}")
        return cls(**kwargs)


_STR_FIELDS = {"kind", "dtype", "actual_dtype", "reference_dtype"}
_INT_FIELDS = {
    "numel",
    "compared_count",
    "nonfinite_match_count",
    "inf_nan_mismatch_count",
    "exact_mismatch_count",
    "small_value_count",
}
_OPTIONAL_INT_FIELDS = {"exact_mismatch_count", "small_value_count"}
_FLOAT_STRINGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def encode_float(value: float) -> float | str:
    """Finite floats as is; inf / nan as strings so the JSON stays strict."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def decode_float(value: Any, name: str) -> float | None:
    """Inverse of :func:`encode_float`; None stays None."""
    if value is None:
        return None
    if isinstance(value, str) and value in _FLOAT_STRINGS:
        return _FLOAT_STRINGS[value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{name} must be a number or null, got {value!r}")


def _is_exact_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def compare(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> TensorComparison:
    """Measure ``actual`` (computed in ``dtype``) against ``reference`` (upcast CPU result).

    ``dtype`` selects the rule constants (eps, small-value threshold, ULP width); ``actual`` may
    be stored in another float dtype (e.g. an fp32 ``rstd`` output of a bf16 op). ``reference``
    must be at least the upcast precision: fp32 or fp64 for fp16/bf16, fp64 for fp32.

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
    return TensorComparison(
        kind="exact",
        **common,
        compared_count=n,
        nonfinite_match_count=0,
        inf_nan_mismatch_count=0,
        exact_mismatch_count=int(differ.sum()),
        cosine=None,
        max_abs_error=None,
        max_rel_error=None,
        mean_rel_error=None,
        rel_eps=None,
        dual_hundredth=None,
        dual_thousandth=None,
        dual_ten_thousandth=None,
        rmse=None,
        error_balance=None,
        small_value_threshold=None,
        small_value_count=None,
        small_value_error_share=None,
        ulp_max=None,
        ulp_mean=None,
        ulp_bad_bound=None,
        ulp_bad_share=None,
    )


def _cosine(x: torch.Tensor, r: torch.Tensor) -> float:
    nx = float(torch.linalg.vector_norm(x)) if x.numel() else 0.0
    nr = float(torch.linalg.vector_norm(r)) if r.numel() else 0.0
    if nx == 0.0 and nr == 0.0:
        return 1.0
    if nx == 0.0 or nr == 0.0:
        return 0.0
    cos = float(torch.dot(x, r)) / (nx * nr)
    return min(1.0, max(-1.0, cos))


def _share(mask: torch.Tensor) -> float:
    """Share of True in ``mask``; 1.0 for an empty mask (nothing failed)."""
    n = mask.numel()
    return float(mask.sum()) / n if n else 1.0


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _mean(t: torch.Tensor) -> float:
    return float(t.mean()) if t.numel() else 0.0


def _compare_float(
    actual: torch.Tensor, reference: torch.Tensor, cfg: DtypeConfig, common: dict[str, Any]
) -> TensorComparison:
    x_all = actual.reshape(-1).to(torch.float64)
    r_all = reference.reshape(-1).to(torch.float64)
    # the reference as the actual's storage dtype can hold it (overflow -> inf)
    r_stored = reference.reshape(-1).to(actual.dtype).to(torch.float64)

    x_fin, r_fin = torch.isfinite(x_all), torch.isfinite(r_stored)
    both_finite = x_fin & r_fin
    nonfinite_match = (torch.isnan(x_all) & torch.isnan(r_stored)) | (
        torch.isinf(x_all) & torch.isinf(r_stored) & (x_all == r_stored)
    )
    mismatch = ~both_finite & ~nonfinite_match

    x, r, r_round = x_all[both_finite], r_all[both_finite], r_stored[both_finite]
    n = x.numel()
    diff = x - r
    abs_err = diff.abs()
    abs_ref = r.abs()
    rel_err = abs_err / (abs_ref + cfg.rel_eps)

    small = abs_ref <= cfg.small_value
    small_count = int(small.sum())
    small_bad = int((small & (abs_err > cfg.small_value)).sum())

    # ULP of the reference's exponent in the target dtype
    _, exp = torch.frexp(r)
    floor_log2 = (exp.to(torch.int64) - 1).clamp(cfg.min_exponent, cfg.max_exponent)
    floor_log2 = torch.where(r == 0, torch.full_like(floor_log2, cfg.min_exponent), floor_log2)
    ulp = torch.pow(2.0, (floor_log2 - cfg.mantissa_bits).to(torch.float64))
    ulp_err = abs_err / ulp

    above = int((x > r_round).sum())
    below = int((x < r_round).sum())

    return TensorComparison(
        kind="float",
        **common,
        compared_count=n,
        nonfinite_match_count=int(nonfinite_match.sum()),
        inf_nan_mismatch_count=int(mismatch.sum()),
        exact_mismatch_count=None,
        cosine=_cosine(x, r),
        max_abs_error=_max(abs_err),
        max_rel_error=_max(rel_err),
        mean_rel_error=_mean(rel_err),
        rel_eps=cfg.rel_eps,
        dual_hundredth=_share(rel_err < DUAL_LEVELS["hundredth"]),
        dual_thousandth=_share(rel_err < DUAL_LEVELS["thousandth"]),
        dual_ten_thousandth=_share(rel_err < DUAL_LEVELS["ten_thousandth"]),
        rmse=math.sqrt(_mean(diff * diff)),
        error_balance=abs(above - below) / n if n else 0.0,
        small_value_threshold=cfg.small_value,
        small_value_count=small_count,
        small_value_error_share=small_bad / small_count if small_count else 0.0,
        ulp_max=_max(ulp_err),
        ulp_mean=_mean(ulp_err),
        ulp_bad_bound=cfg.ulp_bad_bound,
        ulp_bad_share=float((ulp_err > cfg.ulp_bad_bound).sum()) / n if n else 0.0,
    )
