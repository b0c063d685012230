"""A small msprobe-style accuracy check (REFERENCE.md section 3), local to the op tests.

Per output, in order: inf/nan positions must match; cosine similarity must be > 0.99; a max
absolute error below 1e-3 passes at once; otherwise the "dual-N" rule: the share of elements
whose relative error ``|x - ref| / (|ref| + eps)`` is below N must exceed ``1 - N``.
fp16/bf16: dual hundredth failing is an error, dual thousandth failing a warning;
fp32: dual thousandth failing is an error, dual ten-thousandth failing a warning.
A reference that is numerically all zero (max |ref| at or below msprobe's small-value bound,
2**-10 for fp16/bf16, 2**-20 for fp32) has no direction, so the cosine step is skipped for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: eps in the relative-error denominator (bf16 2**-8 per msprobe; the others one ULP at 1)
_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-23}
#: msprobe's small-value bound: |ref| at or below it counts as zero
_SMALL = {torch.bfloat16: 2.0**-10, torch.float16: 2.0**-10, torch.float32: 2.0**-20}
_LEVELS = {  # (error threshold, warning threshold)
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (1e-2, 1e-3),
    torch.float32: (1e-3, 1e-4),
}


@dataclass
class Verdict:
    status: str  # "pass", "warning" or "error"
    reason: str
    cosine: float
    max_abs: float

    def __str__(self) -> str:
        return f"{self.status}: {self.reason} (cosine={self.cosine:.6f}, max_abs={self.max_abs:.3g})"


def _dual_share(actual: torch.Tensor, ref: torch.Tensor, n: float, eps: float) -> float:
    rel = (actual - ref).abs() / (ref.abs() + eps)
    return float((rel < n).double().mean())


def judge(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> Verdict:
    """Compare ``actual`` (produced in ``dtype``) with the high-precision ``expected``."""
    dtype = dtype or actual.dtype
    if tuple(actual.shape) != tuple(expected.shape):
        return Verdict("error", f"shape {tuple(actual.shape)} != {tuple(expected.shape)}", 0.0,
                       float("inf"))
    a = actual.detach().double().flatten()
    e = expected.detach().double().flatten()
    if a.numel() == 0:
        return Verdict("pass", "empty", 1.0, 0.0)
    if not torch.equal(torch.isnan(a), torch.isnan(e)) or not torch.equal(
        torch.isinf(a) & (a > 0), torch.isinf(e) & (e > 0)
    ) or not torch.equal(torch.isinf(a) & (a < 0), torch.isinf(e) & (e < 0)):
        return Verdict("error", "inf/nan positions differ", 0.0, float("inf"))
    finite = torch.isfinite(e)
    a, e = a[finite], e[finite]
    if a.numel() == 0:
        return Verdict("pass", "only matching non-finite values", 1.0, 0.0)
    max_abs = float((a - e).abs().max())
    na, ne = float(a.norm()), float(e.norm())
    if float(e.abs().max()) <= _SMALL.get(dtype, 2.0**-20):
        # the reference is numerically zero: it has no direction, the cosine is undefined and
        # the absolute / relative rules below decide
        cosine = float("nan")
    elif na == 0.0:
        cosine = 0.0
    else:
        cosine = float(torch.dot(a, e) / (na * ne))
    if cosine <= 0.99:
        return Verdict("error", "cosine similarity <= 0.99", cosine, max_abs)
    if max_abs < 1e-3:
        return Verdict("pass", "max abs error < 1e-3", cosine, max_abs)
    err_n, warn_n = _LEVELS.get(dtype, _LEVELS[torch.float32])
    eps = _EPS.get(dtype, 2.0**-23)
    share = _dual_share(a, e, err_n, eps)
    if share <= 1.0 - err_n:
        return Verdict("error", f"dual-{err_n:g} share {share:.5f} <= {1 - err_n:g}", cosine,
                       max_abs)
    share = _dual_share(a, e, warn_n, eps)
    if share <= 1.0 - warn_n:
        return Verdict("warning", f"dual-{warn_n:g} share {share:.5f} <= {1 - warn_n:g}",
                       cosine, max_abs)
    return Verdict("pass", f"dual-{warn_n:g} holds", cosine, max_abs)


def assert_accurate(actual, expected, dtype=None, what: str = "") -> Verdict:
    """Fail on an "error" verdict; warnings pass (they are what msprobe reports as such)."""
    verdict = judge(actual, expected, dtype)
    assert verdict.status != "error", f"{what}: {verdict}"
    return verdict
