"""RMSNorm and LayerNorm.

``rms_norm`` returns ``(y, rstd)`` like ``torch_npu.npu_rms_norm``: ``y`` in the input dtype,
``rstd = 1/sqrt(mean(x^2) + eps)`` in fp32 over the weight's trailing dims (kept as size 1).
The weight may be fp32 while x is fp16/bf16. Both paths compute in fp32 and round once.

``layer_norm`` returns ``(y, mean, rstd)`` with ``torch.native_layer_norm`` semantics on every
device (on CPU, fp16/bf16 inputs are computed in fp32 with y rounded once and fp32 mean/rstd).
torch_npu has no training layer-norm op in its own namespace (``npu_layer_norm_eval`` is
inference-only and slated for removal in favour of ``torch.nn.functional.layer_norm``); on an NPU
the aten op itself is torch_npu's kernel, so there is no separate NPU binding.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron_npu.ops._common import check_float_dtype, dtype_name
from megatron_npu.ops.kernels import npu_kernels


def _check_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    op = "rms_norm"
    check_float_dtype(op, "x", x)
    check_float_dtype(op, "weight", weight)
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(
            f"{op}: weight dtype {dtype_name(weight.dtype)} must equal x dtype "
            f"{dtype_name(x.dtype)} or be float32"
        )
    if not 2 <= x.dim() <= 8:
        raise ValueError(f"{op}: x must have 2 to 8 dims, got {x.dim()}")
    k = weight.dim()
    if k < 1 or k > x.dim() or tuple(x.shape[-k:]) != tuple(weight.shape):
        raise ValueError(
            f"{op}: weight shape {tuple(weight.shape)} must equal the trailing dims of x "
            f"{tuple(x.shape)}"
        )
    if eps < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")


def native_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rms(x, weight, eps)
    dims = tuple(range(x.dim() - weight.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    y = (xf * rstd * weight.float()).to(x.dtype)
    return y, rstd


def npu_rms_norm(
    kernels: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Through ``kernels.npu_rms_norm(x, gamma, epsilon)`` (positional tensors: the real
    schema names the first one ``self``)."""
    _check_rms(x, weight, eps)
    y, rstd = kernels.npu_rms_norm(x, weight, epsilon=eps)
    return y, rstd


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` on the NPU kernel module in use, else natively."""
    kernels = npu_kernels("npu_rms_norm")
    if kernels is not None:
        return npu_rms_norm(kernels, x, weight, eps)
    return native_rms_norm(x, weight, eps)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    normalized_shape: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` of ``torch.native_layer_norm`` over ``normalized_shape`` (default:
    the weight's shape, else the last dim). Same call on every device (see module docstring)."""
    op = "layer_norm"
    check_float_dtype(op, "x", x)
    if normalized_shape is None:
        normalized_shape = tuple(weight.shape) if weight is not None else (x.shape[-1],)
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if k < 1 or k > x.dim() or tuple(x.shape[-k:]) != normalized_shape:
        raise ValueError(
            f"{op}: normalized_shape {normalized_shape} must equal the trailing dims of x "
            f"{tuple(x.shape)}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != normalized_shape:
            raise ValueError(
                f"{op}: {name} shape {tuple(t.shape)} must equal normalized_shape "
                f"{normalized_shape}"
            )
    if x.device.type == "cpu" and x.dtype != torch.float32:
        # the CPU 16-bit kernel accumulates the weight gradient in 16 bits and misses the
        # fp16/bf16 accuracy rule: compute in fp32 and round y once (mean/rstd stay fp32, as
        # the CUDA and NPU kernels return them for 16-bit inputs)
        y, mean, rstd = torch.native_layer_norm(
            x.float(),
            list(normalized_shape),
            None if weight is None else weight.float(),
            None if bias is None else bias.float(),
            eps,
        )
        return y.to(x.dtype), mean, rstd
    return torch.native_layer_norm(x, list(normalized_shape), weight, bias, eps)
