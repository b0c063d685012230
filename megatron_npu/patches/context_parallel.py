"""Context parallelism through TE's core attention: the adaptor's ``TEDotProductAttention``
takes ``--context-parallel-size`` above 1 and the registry entry
``transformer-engine.context-parallel-attention`` (declared with the TE stand-ins in
:mod:`megatron_npu.patches.transformer_engine`, after the class it wraps) routes its calls to the
context-parallel op (:mod:`megatron_npu.ops.context_parallel`: ``p2p`` ring, ``a2a`` Ulysses,
``allgather``, ``a2a+p2p`` hybrid) with the layer's comm type over Megatron's context-parallel
group (for ``a2a+p2p`` its pair of hierarchical groups); a layer of one context-parallel rank
runs the class's own forward.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_npu.patches.attention import (
    core_attention_call,
    in_attention_rng,
    one_head_dim,
    value_columns,
)


def context_parallel_core_attention(
    module: Any, query, key, value, attention_mask, attn_mask_type, group, comm_type: str
) -> Any:
    """TE's context-parallel core attention: Megatron's [s/CP, b, np, hn] load-balanced rows ->
    [s/CP, b, np*hn] through :func:`~megatron_npu.ops.context_parallel.context_parallel_attention`.
    As in TE, a causal call does not read ``attention_mask`` (the dataloader's causal mask, split
    by ``get_batch_on_this_cp_rank``); a padding or arbitrary mask is refused by name."""
    from megatron_npu.ops.context_parallel import ContextParallelError, context_parallel_attention

    call = core_attention_call(module, attention_mask, attn_mask_type)
    query, key, value, value_dim = one_head_dim(query, key, value)
    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    if mask_type.name not in ("causal", "no_mask"):
        raise ContextParallelError(
            f"context parallelism serves causal and unmasked attention; "
            f"attention mask type {mask_type.name} is not served"
        )

    def run():
        return context_parallel_attention(
            query,
            key,
            value,
            group,
            comm_type=comm_type,
            causal=call.causal or call.next_tokens == 0,  # a window (left, 0) is causal
            scale=call.scale,
            dropout_p=call.dropout_p,
            pre_tokens=call.pre_tokens,
            next_tokens=call.next_tokens,
        )

    out = in_attention_rng(module, call.dropout_p, run)
    return value_columns(out, query.shape[2], query.shape[3], value_dim)


def route_context_parallel(original: Any) -> Any:
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
        num_splits=None,
    ):
        group = getattr(self, "cp_group", None)
        if group is None:
            return original(
                self,
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias,
                packed_seq_params,
                num_splits,
            )
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "context parallelism: attention_bias and packed sequences (THD) are "
                "not served by the adaptor"
            )
        return context_parallel_core_attention(
            self, query, key, value, attention_mask, attn_mask_type, group, self.cp_comm_type
        )

    return forward
