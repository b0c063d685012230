"""Bias-GELU with the tanh approximation (Megatron's ``bias_gelu`` formula)::

    y = 0.5 * z * (1 + tanh(sqrt(2/pi) * (z + 0.044715 * z^3))),   z = x + bias

The NPU binding calls ``torch_npu.npu_gelu(z, approximate='tanh')``, which documents exactly that
formula (``approximate='none'`` is the exact erf GELU, also accepted here). It deliberately
does not use ``npu_fast_gelu``: its formula differs between chip generations
(``x / (1 + exp(-1.702|x|)) * exp(0.851 (x - |x|))`` on Atlas A2/A3, another on older chips),
so it would not match Megatron on every NPU.

Both paths compute in fp32 (bias add included) and round the output once; Megatron's jit
``bias_gelu`` works in the input dtype, which makes its fp16/bf16 bias gradient (a sum of
rounded per-token terms) miss the fp16/bf16 accuracy rule when the terms cancel.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from megatron_npu.ops._common import check_float_dtype
from megatron_npu.ops.kernels import npu_kernels

APPROXIMATIONS = ("tanh", "none")


def _check(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> None:
    op = "bias_gelu"
    check_float_dtype(op, "x", x)
    if bias is not None:
        check_float_dtype(op, "bias", bias)
        if bias.dim() > x.dim() or tuple(bias.shape) != tuple(x.shape[x.dim() - bias.dim() :]):
            raise ValueError(
                f"{op}: bias shape {tuple(bias.shape)} must equal the trailing dims of x "
                f"{tuple(x.shape)}"
            )
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be 'tanh' or 'none', got {approximate!r}")


def _z32(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x + bias`` in fp32: the GELU runs in fp32 and is rounded once, so the bias gradient
    (a sum over every token) adds up fp32 terms instead of rounded 16-bit ones."""
    z = x.float()
    return z if bias is None else z + bias.float()


def native_bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    _check(x, bias, approximate)
    return F.gelu(_z32(x, bias), approximate=approximate).to(x.dtype)


def npu_bias_gelu(
    kernels: ModuleType,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    _check(x, bias, approximate)
    return kernels.npu_gelu(_z32(x, bias), approximate=approximate).to(x.dtype)


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    """GELU(x + bias) on the NPU kernel module in use, else natively."""
    kernels = npu_kernels("npu_gelu")
    if kernels is not None:
        return npu_bias_gelu(kernels, x, bias, approximate)
    return native_bias_gelu(x, bias, approximate)
