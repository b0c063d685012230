"""Rotary position embedding multiply: ``x * r1 + rotate(x) * r2`` (r1 = cos, r2 = sin).

``rotary_mode='half'`` rotates ``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim
(Megatron's default), ``'interleave'`` over (even, odd) pairs (Megatron's
``rotary_interleaved``). Same contract as ``torch_npu.npu_rotary_mul(input, r1, r2,
rotary_mode)``: 4-D tensors, even D < 896, r1/r2 broadcast to x with the full D (interleave
mode: only 11SD / 1S1D / S11D). r1/r2 are cast to x's dtype (as Megatron does before the
multiply); the native path computes in fp32 and rounds once.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron_npu.ops._common import check_float_dtype
from megatron_npu.ops.kernels import npu_kernels

MODES = ("half", "interleave")


def _check(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> None:
    op = "rotary_mul"
    for name, t in (("x", x), ("r1", r1), ("r2", r2)):
        check_float_dtype(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D, got shape {tuple(t.shape)}")
    if mode not in MODES:
        raise ValueError(f"{op}: rotary_mode must be 'half' or 'interleave', got {mode!r}")
    d = x.shape[-1]
    if d % 2 or d >= 896:
        raise ValueError(f"{op}: head dim D={d} must be even and < 896")
    if r1.shape != r2.shape:
        raise ValueError(f"{op}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} shapes differ")
    if r1.shape[-1] != d or any(
        r not in (1, s) for r, s in zip(r1.shape[:3], x.shape[:3], strict=True)
    ):
        raise ValueError(
            f"{op}: r1/r2 shape {tuple(r1.shape)} must broadcast to x {tuple(x.shape)} with "
            "the full last dim"
        )
    if mode == "interleave" and sum(r != 1 for r in r1.shape[:3]) > 1:
        raise ValueError(
            f"{op}: interleave mode takes r1/r2 shaped 11SD, 1S1D or S11D, got {tuple(r1.shape)}"
        )


def rotate(x: torch.Tensor, mode: str = "half") -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over halves ('half') or even/odd pairs ('interleave')."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def native_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    _check(x, r1, r2, rotary_mode)
    xf = x.float()
    cos = r1.to(x.dtype).float()
    sin = r2.to(x.dtype).float()
    return (xf * cos + rotate(xf, rotary_mode) * sin).to(x.dtype)


def npu_rotary_mul(
    kernels: ModuleType,
    x: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
) -> torch.Tensor:
    _check(x, r1, r2, rotary_mode)
    return kernels.npu_rotary_mul(x, r1.to(x.dtype), r2.to(x.dtype), rotary_mode=rotary_mode)


def rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    """Rotary multiply on the NPU kernel module in use, else natively."""
    kernels = npu_kernels("npu_rotary_mul")
    if kernels is not None:
        return npu_rotary_mul(kernels, x, r1, r2, rotary_mode)
    return native_rotary_mul(x, r1, r2, rotary_mode)


def regrouped_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Multi-latent attention's rotation of ``x`` ``[s, b, n, d]``: the even features, then the
    odd ones, rotated by halves against ``cos``/``sin`` ``[s, 1, 1, d]`` (YaRN's scale already
    folded in, so they may leave [-1, 1], which ``npu_rotary_mul`` does not take): fp32, one
    rounding to x's dtype."""
    if x.dim() != 4 or cos.shape != sin.shape or cos.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"regrouped_rotary: x [s, b, n, d] and cos/sin [s, 1, 1, d] expected, got "
            f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    xf = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1).float()
    return (xf * cos.float() + rotate(xf, "half") * sin.float()).to(x.dtype)
