"""16-bit matrix products computed as one fp32 product rounded once.

An NPU's matrix unit, a GPU's tensor cores and PyTorch's own CPU kernels all multiply fp16 and
bf16 matrices by accumulating in fp32 and rounding the result to the operands' dtype once. A CPU
without 16-bit matrix instructions runs that arithmetic in PyTorch's scalar fallback: on the
2-core machines this project is tested on, a bf16 GEMM ran at 1.1 GFLOP/s per core against fp32's
65 (fp16 at 1.8 on a CPU whose bf16 reaches 193). Upcasting both operands, multiplying in fp32
and rounding once is the same arithmetic at fp32's pace; the results differ from PyTorch's own
16-bit kernel only where a different summation order moves the final rounding.

:func:`fp32_accumulated` wraps one torch product (``torch.matmul``, ``Tensor.matmul``, ``@``,
``torch.mm``, ``torch.bmm``, ``torch.baddbmm``, ``F.linear``). Autograd differentiates through the
casts, so the backward products are fp32 products rounded once as well, and a custom autograd
function that calls the product in its backward (Megatron's tensor-parallel linear) gets the same.
The product is served this way only when every tensor argument is a CPU tensor of one 16-bit
dtype. With ``out=`` an fp32 buffer, the fp32 product is written there unrounded: the
weight-gradient GEMM of Megatron-FSDP (``torch.matmul(grad_output.t(), total_input,
out=weight.main_grad)``) asks for what a GPU's GEMM gives it through Transformer Engine, a 16-bit
product accumulated and kept in fp32, and torch's own kernels refuse a buffer of another dtype.
Anything else (fp32 operands, mixed dtypes, a 16-bit buffer) reaches the original unchanged, with
its own errors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

#: the dtypes whose products are computed in fp32 and rounded once
HALF_DTYPES = (torch.float16, torch.bfloat16)


def half_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The one 16-bit dtype of every tensor argument, when all are CPU tensors of it; else None."""
    dtype = None
    for value in (*args, *kwargs.values()):
        if not isinstance(value, torch.Tensor):
            continue
        if dtype is None:
            dtype = value.dtype
            if dtype not in HALF_DTYPES:  # the fp32 path ends at its first operand
                return None
        if value.dtype != dtype or value.device.type != "cpu":
            return None
    return dtype


def _upcast(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) else value


def fp32_accumulated(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``original`` with 16-bit CPU operands multiplied as fp32 and the product rounded once."""

    @functools.wraps(original)
    def product(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = kwargs.pop("out", None)
        dtype = half_dtype(args, kwargs)
        if dtype is None or (out is not None and out.dtype != torch.float32):
            return original(*args, **kwargs) if out is None else original(*args, **kwargs, out=out)
        upcast_args = tuple(_upcast(a) for a in args)
        upcast_kwargs = {k: _upcast(v) for k, v in kwargs.items()}
        if out is not None:  # an fp32 buffer takes the fp32 product as it is
            return original(*upcast_args, **upcast_kwargs, out=out)
        return original(*upcast_args, **upcast_kwargs).to(dtype)

    return product
