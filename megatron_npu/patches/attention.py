"""Megatron's core attention -> the fused-attention op (``npu_fusion_attention`` on the NPU).

``DotProductAttention.forward`` keeps Megatron's unfused path unless the run asked for the fused
kernel (``--use-flash-attn``, or a pre/next-token window, or the BSH layout: see
:mod:`megatron_npu.ops.settings`). The fused path lays q/k/v out as SBH or BSH as configured,
applies the causal mask and pre/next window through the op, and a supplied attention mask too
(document masks from ``--reset-attention-mask`` are honoured; Megatron's plain causal mask is
recognised and costs nothing), the softmax scale Megatron computed,
attention dropout inside the model-parallel RNG fork, and grouped-query attention natively.

On ``cuda`` the same entry serves ``--use-flash-attn`` without the ``flash_attn`` package or
Transformer Engine: the op's native path is ``scaled_dot_product_attention``, whose flash kernel
takes the causal case in 16 bits and whose memory-efficient kernel the masked and windowed ones.
Runs that ask for none of the fused options keep Megatron's code on every device.

A layer with Megatron's sliding window (``--window-size left,right``; the layers
``--window-attn-skip-freq`` picks) keeps it on the fused path: Megatron's own softmax then
replaces the mask by the band ``-left <= j - i <= right`` (``get_sliding_window_causal_mask``),
so the fused op gets ``pre_tokens=left``, ``next_tokens=right`` (narrowed further by a pre/next
window the run asked for), no causal flag and no other mask, exactly that band.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from megatron_npu.devices.facts import DEVICES
from megatron_npu.ops import settings
from megatron_npu.ops.attention import MAX_TOKENS, fused_attention
from megatron_npu.registry import Patch

_TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"


class CoreAttentionCall(NamedTuple):
    """What one core-attention call of a Megatron module asks for, in the op's terms."""

    causal: bool
    attention_mask: Any
    pre_tokens: int
    next_tokens: int
    scale: float
    dropout_p: float


def core_attention_call(module: Any, attention_mask, attn_mask_type) -> CoreAttentionCall:
    """The mask, window, softmax scale and dropout of ``module``'s (Megatron's
    ``DotProductAttention``) call, as the fused-attention op takes them."""
    from megatron.core.transformer.enums import AttnMaskType

    chosen = settings.fused_attention()
    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    causal = mask_type == AttnMaskType.causal
    pre_tokens, next_tokens = chosen.pre_tokens, chosen.next_tokens
    window = getattr(module.scale_mask_softmax, "window_size", None)
    if window is not None:  # the band replaces the mask, as in Megatron's softmax
        left, right = (MAX_TOKENS if w < 0 else int(w) for w in window)
        pre_tokens, next_tokens = min(pre_tokens, left), min(next_tokens, right)
        causal, attention_mask = False, None
    dropout_p = module.config.attention_dropout if module.training else 0.0
    # With apply_query_key_layer_scaling Megatron divides softmax_scale by the layer number and
    # its softmax multiplies the scores back: the effective scale is the product.
    scale = module.softmax_scale * (module.scale_mask_softmax.scale or 1.0)
    return CoreAttentionCall(causal, attention_mask, pre_tokens, next_tokens, scale, dropout_p)


def in_attention_rng(module: Any, dropout_p: float, run: Callable[[], Any]) -> Any:
    """``run()`` inside the model-parallel RNG fork where Megatron draws attention dropout."""
    from megatron.core import tensor_parallel

    if dropout_p > 0 and not module.config.sequence_parallel:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return run()
    return run()


def one_head_dim(query, key, value) -> tuple[Any, Any, Any, int]:
    """q/k/v of one head dimension, as the fused kernels take them, and the value's own.

    Multi-latent attention's q/k heads are wider than its v heads (DeepSeek-V3: 192 and 128).
    The narrower side is padded with zeros to the wider: zero columns of q and k add nothing to
    q.k (the scale is passed, never derived from the width), and zero columns of v give zero
    output columns, which the caller drops (``[..., :value_dim]``); so the result and its
    gradients are exactly those of the unpadded attention."""
    value_dim = value.shape[-1]
    width = max(query.shape[-1], value_dim)

    def padded(t):
        extra = width - t.shape[-1]
        return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))

    return padded(query), padded(key), padded(value), value_dim


def value_columns(out, heads: int, width: int, value_dim: int) -> Any:
    """``out`` ``[s, b, heads * width]`` of heads padded by :func:`one_head_dim` ->
    ``[s, b, heads * value_dim]``, each head's padded columns dropped."""
    if value_dim == width:
        return out
    s, b = out.shape[:2]
    return out.reshape(s, b, heads, width)[..., :value_dim].reshape(s, b, heads * value_dim)


def fused_core_attention(module: Any, query, key, value, attention_mask, attn_mask_type) -> Any:
    """Megatron's [s, b, np, hn] q/k/v -> [s, b, np*hn] context through the fused op (q/k and v
    heads of different widths: :func:`one_head_dim`)."""
    chosen = settings.fused_attention()
    query, key, value, value_dim = one_head_dim(query, key, value)
    sq, b, heads, dim = query.shape
    call = core_attention_call(module, attention_mask, attn_mask_type)
    if chosen.shape_order == "SBH":
        q, k, v = (t.reshape(t.shape[0], b, -1) for t in (query, key, value))
    else:  # BSH
        q, k, v = (t.transpose(0, 1).reshape(b, t.shape[0], -1) for t in (query, key, value))

    def run():
        return fused_attention(
            q,
            k,
            v,
            head_num=heads,
            input_layout=chosen.shape_order,
            causal=call.causal,
            attention_mask=call.attention_mask,
            pre_tokens=call.pre_tokens,
            next_tokens=call.next_tokens,
            scale=call.scale,
            dropout_p=call.dropout_p,
        )

    out = in_attention_rng(module, call.dropout_p, run)
    if chosen.shape_order == "BSH":
        out = out.transpose(0, 1)
    return value_columns(out.reshape(sq, b, heads * dim), heads, dim, value_dim)


def _route_to_fused(original: Any) -> Any:
    @functools.wraps(original)
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if not settings.fused_attention().needs_fused_kernel:
            return original(
                self,
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias,
                packed_seq_params,
            )
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "fused attention does not take attention_bias or packed sequences; "
                "run without --use-flash-attn for those"
            )
        return fused_core_attention(self, query, key, value, attention_mask, attn_mask_type)

    return forward


PATCHES = [
    Patch(
        id="attention.dot-product",
        target=_TARGET,
        replacement=_route_to_fused,
        kind="wrap",
        reason="flash/sparse attention (SBH/BSH, pre/next window) through the fused-attention op",
        versions=">=0.13",
        # on cuda too: the native path is torch's fused attention there (SDPA's flash and
        # memory-efficient kernels), and Megatron's local spec has no flash attention of its own
        devices=DEVICES,
        parity="megatron_npu.parity.cases.attention:DOT_PRODUCT_ATTENTION",
        benchmark="perf.cases.attention:DOT_PRODUCT_ATTENTION",
        npu_kernels=("npu_fusion_attention",),
    ),
]
