"""The router's top-k through torch_npu's gating kernel (``--moe-router-fusion``).

Megatron's ``topk_routing_with_score_function`` turns the router logits [tokens, experts] into
the routing probabilities and map; with ``fused=True`` it calls TE's fused kernel. On the NPU
the same is ``npu_moe_gating_top_k`` forward and ``npu_moe_gating_top_k_backward`` for the
logits' gradient, where the two agree: sigmoid scores (the backward kernel knows no other),
top-k above 1 (the kernel always divides the k weights by their sum, Megatron only for k > 1),
fp32 logits (Megatron rounds the sigmoid to the logits' dtype before choosing; the kernel keeps
fp32, so 16-bit logits could choose differently: ``--moe-router-dtype fp32`` gives fp32 logits),
and group-limited routing only where Megatron's group score, the sum of each group's best
``topk // group_topk`` scores, is one of the kernel's (its best score, or its two best). The
expert bias is added for the choice only on both sides, and the scaling factor multiplies the
normalised weights on both. Every other routing runs Megatron's unfused code.
"""

from __future__ import annotations

from types import ModuleType

import torch

#: Megatron's constant in the sigmoid normalisation ``scores / (sum + 1e-20)``
EPS = 1e-20
#: the kernel's expert-count limits
MIN_EXPERTS, MAX_EXPERTS = 2, 2048


def gating_kernel_groups(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    num_groups: int | None,
    group_topk: int | None,
) -> tuple[int, int, int] | None:
    """(group_count, k_group, group_select_mode) for the kernel, or None where the kernel's
    routing is not Megatron's for these options."""
    experts = logits.shape[-1]
    if score_function != "sigmoid" or topk < 2 or logits.dtype != torch.float32:
        return None
    if logits.dim() != 2 or not MIN_EXPERTS <= experts <= MAX_EXPERTS:
        return None
    if not (num_groups and group_topk):
        return 1, 1, 0
    per_group = topk // group_topk
    if experts % num_groups or per_group not in (1, 2) or experts // num_groups < per_group:
        return None
    return num_groups, group_topk, per_group - 1


class _NpuSigmoidTopK(torch.autograd.Function):
    """The routed weights [tokens, k] and their experts; the logits' gradient from the backward
    kernel (the expert bias gets none: it only chooses)."""

    @staticmethod
    def forward(ctx, kernels, logits, topk, bias, groups, scaling):
        group_count, k_group, mode = groups
        weights, idx, scores = kernels.npu_moe_gating_top_k(
            logits,
            topk,
            bias=bias,
            k_group=k_group,
            group_count=group_count,
            group_select_mode=mode,
            renorm=0,
            norm_type=1,
            out_flag=True,
            routed_scaling_factor=scaling,
            eps=EPS,
        )
        ctx.kernels, ctx.scaling = kernels, scaling
        ctx.save_for_backward(scores, idx)
        ctx.mark_non_differentiable(idx)
        return weights, idx

    @staticmethod
    def backward(ctx, grad_weights, _grad_idx):
        scores, idx = ctx.saved_tensors
        grad_logits = ctx.kernels.npu_moe_gating_top_k_backward(
            scores,
            grad_weights.contiguous(),
            idx,
            renorm=0,
            norm_type=1,
            routed_scaling_factor=ctx.scaling,
            eps=EPS,
        )
        return None, grad_logits, None, None, None, None


def npu_sigmoid_top_k(
    kernels: ModuleType,
    logits: torch.Tensor,
    topk: int,
    expert_bias: torch.Tensor | None,
    groups: tuple[int, int, int],
    scaling_factor: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing probs, routing map), both [tokens, experts], as Megatron builds them from the
    top-k weights and indices."""
    bias = None if expert_bias is None else expert_bias.to(logits.dtype)
    weights, idx = _NpuSigmoidTopK.apply(
        kernels, logits, topk, bias, groups, float(scaling_factor or 1.0)
    )
    idx = idx.long()
    probs = torch.zeros_like(logits).scatter(1, idx, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map
