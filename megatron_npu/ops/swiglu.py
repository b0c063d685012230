"""SwiGLU: ``silu(A) * B`` where A, B are the first and second halves of ``x`` along ``dim``.

Same definition as Megatron's ``bias_swiglu`` (``silu(y[..., :h]) * y[..., h:]``) and
``torch_npu.npu_swiglu(x, dim=-1)``.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from megatron_npu.ops._common import check_float_dtype
from megatron_npu.ops.kernels import npu_kernels


def _check(x: torch.Tensor, dim: int) -> None:
    op = "swiglu"
    check_float_dtype(op, "x", x)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim {dim} out of range for a {x.dim()}-D x")
    if x.shape[dim] % 2:
        raise ValueError(f"{op}: x size {x.shape[dim]} along dim {dim} must be even")


def native_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    _check(x, dim)
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_swiglu(kernels: ModuleType, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    _check(x, dim)
    return kernels.npu_swiglu(x, dim=dim)


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU on the NPU kernel module in use, else natively."""
    kernels = npu_kernels("npu_swiglu")
    if kernels is not None:
        return npu_swiglu(kernels, x, dim)
    return native_swiglu(x, dim)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """``swiglu(x + bias)`` (Megatron's fused bias-SwiGLU), computed in fp32 and rounded once.

    In fp16/bf16 the bias add and the product each round; summed over tokens, the bias gradient
    then misses the accuracy rule (as Megatron's own half-precision version does). Upcasting
    keeps one rounding of the output and fp32 accumulation of the gradients.
    """
    z = x.float() if bias is None else x.float() + bias.float()
    return swiglu(z, dim).to(x.dtype)
