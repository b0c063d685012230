"""Scaled masked softmax (Megatron's fused softmax) and its availability rule.

``scaled_masked_softmax(x, mask, scale, causal)`` = softmax over the last dim of ``x * scale``
with masked positions (True = masked) set to -10000 before the softmax, as Megatron's fused
kernels and ``attention_mask_func`` do (so a fully masked row comes out uniform). ``causal``
adds the upper triangle (key > query). Computed in fp32, returned in x's dtype.

The contract is the NPU kernel's on every device, so code checked on CPU does not fail on an
NPU: x is 4-D ``[b, np, sq, sk]`` in fp16/bf16/fp32, ``sq`` and ``sk`` each in [32, 4096] and
divisible by 32, mask bool and broadcastable to x.

The NPU binding calls ``torch_npu.npu_scaled_masked_softmax(x, mask, scale, False)``; for
``causal`` it passes an explicit upper-triangular mask because ``fixed_triu_mask`` is documented
as a reserved parameter that only accepts False.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron_npu.ops._common import broadcastable, check_float_dtype, dtype_name
from megatron_npu.ops.kernels import npu_kernels

MIN_DIM, MAX_DIM, DIM_MULTIPLE = 32, 4096, 32
MASK_FILL = -10000.0


def is_fused_softmax_available(
    dtype: torch.dtype, b: int, np: int, sq: int, sk: int, *, fusion_enabled: bool = True
) -> bool:
    """Rule for ``FusedScaleMaskSoftmax.is_kernel_available`` on the NPU.

    Fused only if the user asked for fusion, the input is 16-bit (fp16 *or* bf16: Megatron's
    ``input_in_float16`` is ``input_in_fp16 or input_in_bf16`` despite its "must be fp16"
    comment) and both ``sq`` and ``sk`` meet the kernel's documented limits (32..4096, multiple
    of 32). This is stricter than MindSpeed's patch (``32 < sk <= 4096``, ``sq % 16 == 0``,
    ``sk % 16 == 0``), which admits shapes such as sq=16 or sk=48 that the kernel rejects, and
    drops Megatron's CUDA-only conditions (``b * np % 4``, batch-per-block) that have no
    meaning for the NPU kernel. ``b`` and ``np`` are kept for the Megatron signature.
    """
    del b, np
    return bool(
        fusion_enabled
        and dtype in (torch.float16, torch.bfloat16)
        and all(MIN_DIM <= s <= MAX_DIM and s % DIM_MULTIPLE == 0 for s in (sq, sk))
    )


def _check(x: torch.Tensor, mask: torch.Tensor | None) -> None:
    op = "scaled_masked_softmax"
    check_float_dtype(op, "x", x)
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D [b, np, sq, sk], got shape {tuple(x.shape)}")
    for name, s in (("sq", x.shape[2]), ("sk", x.shape[3])):
        if not (MIN_DIM <= s <= MAX_DIM and s % DIM_MULTIPLE == 0):
            raise ValueError(
                f"{op}: {name}={s} must be in [{MIN_DIM}, {MAX_DIM}] and divisible by "
                f"{DIM_MULTIPLE}"
            )
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(
                f"{op}: mask dtype must be bool (True = masked), got {dtype_name(mask.dtype)}"
            )
        if not broadcastable(tuple(mask.shape), tuple(x.shape)):
            raise ValueError(
                f"{op}: mask shape {tuple(mask.shape)} must broadcast to x {tuple(x.shape)}"
            )


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(diagonal=1)


def _full_mask(x: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    if causal:
        tri = _causal_mask(x.shape[2], x.shape[3], x.device)
        return tri if mask is None else mask | tri
    return mask


def native_scaled_masked_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
) -> torch.Tensor:
    _check(x, mask)
    logits = x.float() * scale
    full = _full_mask(x, mask, causal)
    if full is not None:
        logits = logits.masked_fill(full, MASK_FILL)
    return torch.softmax(logits, dim=-1).to(x.dtype)


def npu_scaled_masked_softmax(
    kernels: ModuleType,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
) -> torch.Tensor:
    _check(x, mask)
    full = _full_mask(x, mask, causal)
    if full is None:  # the kernel always takes a mask
        full = torch.zeros(1, 1, x.shape[2], x.shape[3], dtype=torch.bool, device=x.device)
    return kernels.npu_scaled_masked_softmax(x, full, scale, False)


def scaled_masked_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled masked softmax on the NPU kernel module in use, else natively."""
    kernels = npu_kernels("npu_scaled_masked_softmax")
    if kernels is not None:
        return npu_scaled_masked_softmax(kernels, x, mask, scale, causal)
    return native_scaled_masked_softmax(x, mask, scale, causal)
