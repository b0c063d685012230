"""MoE token permutation through torch_npu's routing-map kernels (``--moe-permute-fusion``).

The token dispatchers copy each token once per selected expert, grouped by expert
(``moe_utils.permute``), and sum the experts' outputs back per token (``moe_utils.unpermute``).
With ``--moe-permute-fusion`` Megatron hands both to TE's fused kernels; on the NPU the same
contract is one ``npu_moe_token_permute_with_routing_map`` and one
``npu_moe_token_unpermute_with_routing_map`` call, gradients included.

The kernels order the permuted rows exactly as Megatron does (expert-major, tokens in order,
the first ``capacity`` tokens of each expert with ``drop_and_pad``), so the experts see the same
rows. Their index map differs from Megatron's: without ``drop_and_pad`` it maps each
(token, k-th expert) slot to its row, which needs every token to select the same number of
experts. That holds for the alltoall dispatcher and for the allgather dispatcher with one
expert-parallel rank, but not where tokens were dropped without padding or where the map holds
only a rank's local experts, nor for fp32 probs with fp16 tokens; those calls go through Megatron's
own unfused code (the check costs one host read of a flag per permutation). A kernel-made map is
int32 (torch_npu's contract) and Megatron's own int64, which is how the unpermute tells which one it
was handed.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

#: the dtype of the index map the permute kernel returns (Megatron's own is int64)
KERNEL_INDEX_DTYPE = torch.int32


def kernel_takes_probs(tokens: torch.Tensor, probs: torch.Tensor | None) -> bool:
    """The kernels take probs of the tokens' dtype, or fp32 probs with bf16 tokens (so fp16
    tokens with ``--moe-router-dtype fp32`` probs are not theirs)."""
    return (
        probs is None
        or probs.dtype == tokens.dtype
        or (probs.dtype == torch.float32 and tokens.dtype == torch.bfloat16)
    )


def kernel_num_out_tokens(
    routing_map: torch.Tensor, num_out_tokens: Any, drop_and_pad: bool
) -> int | None:
    """``num_out_tokens`` for the permute kernel, or None where its contract does not hold for
    this routing map (Megatron's unfused code serves those). Without ``drop_and_pad`` the
    kernel's count is top-k x tokens, which is what the dispatchers pass when every token
    selects top-k experts."""
    tokens_num, experts_num = routing_map.shape
    if tokens_num == 0 or experts_num == 0:
        return None
    if drop_and_pad:
        return None if num_out_tokens is None else int(num_out_tokens)
    per_token = routing_map.sum(dim=1)
    topk = per_token[0]
    if not bool((per_token == topk).all()):
        return None  # tokens dropped without padding, or only the local experts' columns
    return int(topk) * tokens_num


def permute_with_kernel(
    kernels: ModuleType,
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None,
    num_out_tokens: int,
    drop_and_pad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(permuted tokens, permuted probs or None, the kernel's int32 index map)."""
    permuted, permuted_probs, index_map = kernels.npu_moe_token_permute_with_routing_map(
        tokens,
        routing_map,
        probs=probs,
        num_out_tokens=num_out_tokens,
        drop_and_pad=drop_and_pad,
    )
    return permuted, (permuted_probs if probs is not None else None), index_map


def unpermute_with_kernel(
    kernels: ModuleType,
    permuted_tokens: torch.Tensor,
    index_map: torch.Tensor,
    restore_shape: Any,
    probs: torch.Tensor | None,
    routing_map: torch.Tensor | None,
    drop_and_pad: bool,
) -> torch.Tensor:
    """The tokens summed back to ``restore_shape`` from a kernel-made ``index_map``; probs of a
    dtype the kernel does not take are rounded to the tokens' (no dispatcher of megatron-core
    passes probs here: they are applied before the experts' second GEMM)."""
    if not kernel_takes_probs(permuted_tokens, probs):
        probs = probs.to(permuted_tokens.dtype)
    return kernels.npu_moe_token_unpermute_with_routing_map(
        permuted_tokens,
        index_map,
        [int(v) for v in restore_shape],
        probs=probs,
        routing_map=routing_map if probs is not None else None,
        drop_and_pad=drop_and_pad,
    )
