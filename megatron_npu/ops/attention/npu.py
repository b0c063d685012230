"""The NPU binding: the window as torch_npu's ``sparse_mode``, and ``npu_fusion_attention`` /
``npu_fusion_attention_grad`` as one autograd op (see :mod:`megatron_npu.ops.attention`)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import NamedTuple

import torch

from megatron_npu.ops.attention.rules import (
    COMPRESSED_MASK_SIZE,
    INNER_PRECISE_INVALID_ROWS,
    MAX_TOKENS,
    SPARSE_MODE_BAND,
    SPARSE_MODE_DEFAULT,
    SPARSE_MODE_RIGHT_DOWN_CAUSAL,
    checked_inputs,
    mask_fact,
    visible_keys,
    window_bounds,
)


class SparsePlan(NamedTuple):
    """Arguments the NPU binding passes to ``npu_fusion_attention`` for a given window."""

    sparse_mode: int
    atten_mask: torch.Tensor | None
    pre_tockens: int
    next_tockens: int


_compressed_masks: dict[torch.device, torch.Tensor] = {}


def compressed_causal_mask(device: torch.device | str) -> torch.Tensor:
    """The 2048x2048 bool upper triangle (diagonal excluded, True = masked) that torch_npu
    requires as ``atten_mask`` for sparse_mode 2, 3 and 4. Cached per device."""
    device = torch.device(device)
    mask = _compressed_masks.get(device)
    if mask is None:
        n = COMPRESSED_MASK_SIZE
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu_(diagonal=1)
        _compressed_masks[device] = mask
    return mask


def npu_sparse_plan(
    sq: int,
    skv: int,
    *,
    causal: bool,
    pre_tokens: int,
    next_tokens: int,
    attention_mask: torch.Tensor | None,
    device: torch.device | str,
) -> SparsePlan:
    """Map (causal, window, mask) to torch_npu ``sparse_mode``/``atten_mask``/pre/next.

    With ``lo, hi`` the bounds from :func:`window_bounds` (bottom-right aligned):

    * no mask, no restriction -> ``sparse_mode=0``, ``atten_mask=None`` (full attention; the
      kernel ignores pre/next without a mask).
    * no mask, ``hi == 0`` and no left restriction (causal, or next=0 with a window at least
      the sequence long, e.g. pre=next=65536 + causal) -> ``sparse_mode=3`` (rightDownCausal)
      with the compressed 2048x2048 mask; pre/next passed as MAX/0 (ignored by mode 3).
    * no mask, any other window (e.g. pre=2048, next=0, causal) -> ``sparse_mode=4`` (band,
      bottom-right origin) with the compressed mask, ``pre_tockens=pre_tokens`` and
      ``next_tockens=hi`` (``min(next_tokens, 0)`` under causal).
    * explicit mask -> ``sparse_mode=0`` with the mask OR-ed with the window (so the mask
      carries everything); pre/next are the same window in mode 0's top-left coordinates
      (``pre - offset``, ``hi + offset``) when both are >= 0, else MAX/MAX (no block skipping,
      still exact because the mask holds the window).
    """
    lo, hi = window_bounds(sq, skv, causal, pre_tokens, next_tokens)
    offset = skv - sq
    left_bites, right_bites = lo > -(skv - 1), hi < sq - 1
    if attention_mask is None:
        if not left_bites and not right_bites:
            return SparsePlan(SPARSE_MODE_DEFAULT, None, MAX_TOKENS, MAX_TOKENS)
        compressed = compressed_causal_mask(device)
        if not left_bites and hi == 0:
            return SparsePlan(SPARSE_MODE_RIGHT_DOWN_CAUSAL, compressed, MAX_TOKENS, 0)
        pre = min(pre_tokens, MAX_TOKENS)
        nxt = max(min(hi, MAX_TOKENS), -MAX_TOKENS)
        return SparsePlan(SPARSE_MODE_BAND, compressed, pre, nxt)
    masked = attention_mask.bool()
    if left_bites or right_bites:
        hidden = ~visible_keys(0, sq, 0, skv, offset, lo, hi, masked.device)
        masked = masked | hidden
    pre_tl = min(pre_tokens - offset, MAX_TOKENS) if left_bites else MAX_TOKENS
    next_tl = min(hi + offset, MAX_TOKENS) if right_bites else MAX_TOKENS
    if pre_tl < 0 or next_tl < 0:
        pre_tl = next_tl = MAX_TOKENS
    return SparsePlan(SPARSE_MODE_DEFAULT, masked, pre_tl, next_tl)


def npu_fused_attention(
    kernels: ModuleType,
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
    """Fused attention through ``kernels.npu_fusion_attention`` (torch_npu or its emulation)."""
    shape, attention_mask = checked_inputs(
        query, key, value, head_num, input_layout, attention_mask, causal, dropout_p
    )
    plan = npu_sparse_plan(
        shape.sq,
        shape.skv,
        causal=causal,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        attention_mask=attention_mask,
        device=query.device,
    )
    if scale is None:  # the kernel's own default is 1.0, not 1/sqrt(D)
        scale = 1.0 / math.sqrt(shape.head_dim)
    # A fully masked query row ("invalid row") is computed correctly (output 0) only with
    # inner_precise=2 under an explicit mask; the kernel finds such rows itself in modes 2-4.
    # Only a supplied mask can hide a whole row in mode 0; asked once per mask (:func:`mask_fact`).
    dead_rows = (
        attention_mask is not None
        and plan.sparse_mode == SPARSE_MODE_DEFAULT
        and mask_fact(
            attention_mask,
            ("dead-rows", shape.sq, shape.skv, pre_tokens, next_tokens, causal),
            lambda: plan.atten_mask.bool().all(dim=-1).any(),
        )
    )
    outputs = kernels.npu_fusion_attention(
        query,
        key,
        value,
        head_num,
        input_layout,
        atten_mask=plan.atten_mask,
        scale=scale,
        keep_prob=1.0 - dropout_p,
        pre_tockens=plan.pre_tockens,
        next_tockens=plan.next_tockens,
        sparse_mode=plan.sparse_mode,
        inner_precise=INNER_PRECISE_INVALID_ROWS if dead_rows else 0,
    )
    return outputs[0]
