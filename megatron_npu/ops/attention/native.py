"""The native path: ``scaled_dot_product_attention``, with query blocks that see only their
window's keys, and on CPU the band paths of :mod:`.band` (see :mod:`megatron_npu.ops.attention`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_npu.ops.attention import band
from megatron_npu.ops.attention.rules import (
    MAX_TOKENS,
    checked_inputs,
    from_bnsd,
    to_bnsd,
    visible_keys,
    window_bounds,
)


def _block_size(band_width: int) -> int:
    """Query block for the windowed path: big enough to amortise per-call overhead, small
    enough that the keys a block sees stay close to the window."""
    return max(64, min(512, band_width))


def _sdpa(q, k, v, visible, scale, dropout_p, gqa) -> torch.Tensor:
    """SDPA where ``visible`` (True = attend) may leave whole rows empty: those output 0."""
    if visible is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    # no host-side "are there empty rows?": open them for SDPA and zero their output anyway
    empty = ~visible.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible | empty, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return out.masked_fill(empty, 0.0)


def native_fused_attention(
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
    """Device-neutral fused attention on ``scaled_dot_product_attention`` (module docstring)."""
    shape, attention_mask = checked_inputs(
        query, key, value, head_num, input_layout, attention_mask, causal, dropout_p
    )
    sq, skv = shape.sq, shape.skv
    lo, hi = window_bounds(sq, skv, causal, pre_tokens, next_tokens)
    offset = skv - sq
    if scale is None:
        scale = 1.0 / math.sqrt(shape.head_dim)
    gqa = shape.kv_heads != shape.heads
    q = to_bnsd(query, shape.heads, input_layout)
    k = to_bnsd(key, shape.kv_heads, input_layout)
    v = to_bnsd(value, shape.kv_heads, input_layout)
    if query.device.type == "cpu":
        if query.dtype != torch.float32:
            # CPU has no fast 16-bit attention, and its 16-bit backward (which reuses the
            # rounded output) misses the fp16/bf16 accuracy rule on small gradients: compute in
            # fp32 and round the output once. GPUs keep their 16-bit kernels.
            q, k, v = q.float(), k.float(), v.float()
        if gqa:  # SDPA's enable_gqa backward is slow on CPU: share the K/V heads explicitly
            group = shape.heads // shape.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            gqa = False
    user_visible = None if attention_mask is None else attention_mask == 0
    left_bites, right_bites = lo > -(skv - 1), hi < sq - 1

    if user_visible is None and not left_bites and not right_bites:
        out = _sdpa(q, k, v, None, scale, dropout_p, gqa)
    elif user_visible is None and not left_bites and hi == 0 and sq == skv:
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    elif (
        user_visible is None
        and dropout_p == 0.0
        and (block := band.batched_band_block(q, sq, skv, lo, hi))
    ):
        out = band.BatchedBandAttention.apply(q, k, v, -lo, block, scale)
    elif user_visible is None and dropout_p == 0.0 and (plan := band.band_plan(q, sq, skv, lo, hi)):
        out = band.BandAttention.apply(q, k, v, plan, (offset + lo, offset + hi), scale)
    else:
        band_width = hi - lo + 1
        block = _block_size(band_width)
        if band_width + block >= skv:  # the window covers (almost) everything: one call
            visible = visible_keys(0, sq, 0, skv, offset, lo, hi, q.device)
            if user_visible is not None:
                visible = visible & user_visible
            out = _sdpa(q, k, v, visible, scale, dropout_p, gqa)
        else:
            out = _windowed(q, k, v, user_visible, offset, lo, hi, block, scale, dropout_p, gqa)
    return from_bnsd(out.to(query.dtype), input_layout)


def _windowed(q, k, v, user_visible, offset, lo, hi, block, scale, dropout_p, gqa):
    """Query blocks that only look at the keys inside their window."""
    sq, skv = q.shape[2], k.shape[2]
    outs = []
    cache: dict[tuple[int, int, int], torch.Tensor] = {}
    for q0 in range(0, sq, block):
        q1 = min(sq, q0 + block)
        k0 = max(0, q0 + offset + lo)
        k1 = min(skv, q1 - 1 + offset + hi + 1)
        if k1 <= k0:  # no query of this block sees any key
            outs.append(q.new_zeros(q.shape[0], q.shape[1], q1 - q0, v.shape[3]))
            continue
        # the band pattern only depends on where the block sits relative to its keys
        sig = (q1 - q0, k1 - k0, q0 + offset - k0)
        visible = cache.get(sig)
        if visible is None:
            visible = visible_keys(q0, q1, k0, k1, offset, lo, hi, q.device)
            cache[sig] = visible
        if user_visible is not None:
            visible = visible & user_visible[..., q0:q1, k0:k1]
        outs.append(
            _sdpa(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], visible, scale, dropout_p, gqa)
        )
    return torch.cat(outs, dim=2)
