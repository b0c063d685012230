"""Fused (flash) attention: native torch path and the ``npu_fusion_attention`` binding.

Semantics shared by both paths (and by :func:`fused_attention`, which picks one at call time):

* ``input_layout`` is one of ``SBH``, ``BSH``, ``BSND``, ``BNSD``; the output has the layout of
  ``query``. ``H = head_num * D``; key/value may have fewer heads (grouped-query attention) as
  long as the query head count is a multiple of theirs; query head ``n`` reads key/value head
  ``n // (Nq // Nkv)``.
* ``attention_mask`` is bool or uint8, **True/1 means masked out**, shaped ``(B, N, Sq, Skv)``,
  ``(B, 1, Sq, Skv)``, ``(1, 1, Sq, Skv)`` or ``(Sq, Skv)``. With ``causal`` both apply (a key
  is visible where the mask and causality allow it); a mask that is exactly the causal one is
  recognised and dropped (see :func:`without_redundant_causal_mask`). No call compares a mask
  on the host per layer: the shared :func:`causal_mask` is recognised by identity, any other mask
  is classified once per tensor (cached while the tensor lives unmodified).
* Window: with ``offset = Skv - Sq`` (queries aligned to the *end* of the keys, bottom-right, as
  in torch_npu ``sparse_mode`` 3/4 and flash-attention), query ``i`` may attend key ``j`` iff
  ``-pre_tokens <= j - i - offset <= next_tokens``; ``causal=True`` additionally caps the upper
  bound at 0. Hence ``causal`` with ``pre_tokens=next_tokens=65536`` (anything >= the sequence)
  is full causal attention, and ``causal`` with ``pre_tokens=2048, next_tokens=0`` is a causal
  sliding window: each query sees itself and the 2048 keys before it.
* ``scale`` defaults to ``1/sqrt(D)``; ``dropout_p`` is the attention dropout (the kernel is
  passed ``keep_prob = 1 - dropout_p``; pass 0 when not training).
* A query row with no visible key outputs zeros (and gets zero gradient); the NPU binding then
  passes ``inner_precise=2``, the kernel's documented invalid-row mode.
* On CPU, fp16/bf16 inputs are computed in fp32 and the output rounded once.

The native path uses ``torch.nn.functional.scaled_dot_product_attention``. When the window is
narrow compared with the key length it runs query blocks that only see the keys inside their
window, so its cost grows with ``Sq * window`` instead of ``Sq * Skv``. On CPU (fp32 compute,
no user mask, no dropout) a window's forward is the C++ band kernel
(:mod:`megatron_npu.ops.cpu_band_kernel`) where it builds, else ATen flash-kernel pieces merged
by their log-sum-exp; the backward is always the flash pieces' (below).

The NPU binding maps the window to torch_npu ``sparse_mode`` (see :func:`npu_sparse_plan`).

Modules: :mod:`.rules` (shapes, layouts, masks, the window's bounds: what every path shares),
:mod:`.native` (the SDPA path), :mod:`.band` (its CPU band paths), :mod:`.npu` (the kernel
binding); :func:`fused_attention`, here, picks the path at call time.
"""

from __future__ import annotations

import torch

from megatron_npu.ops.attention.native import native_fused_attention
from megatron_npu.ops.attention.npu import (
    SparsePlan,
    compressed_causal_mask,
    npu_fused_attention,
    npu_sparse_plan,
)
from megatron_npu.ops.attention.rules import (
    LAYOUTS,
    MAX_TOKENS,
    SPARSE_MODE_BAND,
    SPARSE_MODE_DEFAULT,
    SPARSE_MODE_RIGHT_DOWN_CAUSAL,
    AttentionShape,
    attention_shape,
    causal_mask,
    check_attention_mask,
    visible_keys,
    window_bounds,
    without_redundant_causal_mask,
)
from megatron_npu.ops.kernels import npu_kernels

__all__ = [
    "LAYOUTS",
    "MAX_TOKENS",
    "SPARSE_MODE_BAND",
    "SPARSE_MODE_DEFAULT",
    "SPARSE_MODE_RIGHT_DOWN_CAUSAL",
    "AttentionShape",
    "SparsePlan",
    "attention_shape",
    "causal_mask",
    "check_attention_mask",
    "compressed_causal_mask",
    "fused_attention",
    "native_fused_attention",
    "npu_fused_attention",
    "npu_sparse_plan",
    "visible_keys",
    "window_bounds",
    "without_redundant_causal_mask",
]


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    head_num: int,
    input_layout: str = "SBH",
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    pre_tokens: int = MAX_TOKENS,
    next_tokens: int = MAX_TOKENS,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Fused attention on the NPU kernel module in use, else the native path."""
    kwargs = dict(
        head_num=head_num,
        input_layout=input_layout,
        causal=causal,
        attention_mask=attention_mask,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        scale=scale,
        dropout_p=dropout_p,
    )
    kernels = npu_kernels("npu_fusion_attention", "npu_fusion_attention_grad")
    if kernels is not None:
        return npu_fused_attention(kernels, query, key, value, **kwargs)
    return native_fused_attention(query, key, value, **kwargs)
