"""Grouped GEMM: one matmul per group of rows, all groups in one call.

``grouped_mm(x, weight, group_sizes)`` multiplies the rows of ``x`` ([M, K]) that belong to group
``g`` (consecutive runs of ``group_sizes[g]`` rows, summing to M) by ``weight[g]`` ([K, N], or
[N, K] with ``trans_b``), giving [M, N]. This is what megatron-core's MoE experts compute: the
tokens permuted by expert, each expert's FFN weight. The contract is ``grouped_gemm.ops.gmm``'s
(Megatron's legacy GroupedMLP) and TE's ``GroupedLinear`` with ``m_splits``.

On the NPU it is one ``npu_grouped_matmul`` call per direction, never one per expert: the forward
splits M (``group_type=0``), the input gradient is the same call on the transposed weights, and
the weight gradient splits K (``group_type=2``: ``x[g].T @ dy[g]`` for every group at once). Group
sizes are passed as counts (``group_list_type=1``). The native path loops over groups with
``torch.mm``; empty groups give empty rows and a zero weight gradient on both paths. Weights come
as one [groups, K, N] tensor (GroupedMLP) or one tensor per group (TE's ``weight0`` ...), and are
passed on as they are, never stacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from megatron_npu.ops._common import check_float_dtype, check_same_dtype
from megatron_npu.ops.kernels import npu_kernels

_OP = "grouped_mm"


def _sizes(group_sizes: torch.Tensor | Sequence[int]) -> list[int]:
    if torch.is_tensor(group_sizes):
        if group_sizes.dim() != 1 or group_sizes.is_floating_point():
            raise ValueError(f"{_OP}: group_sizes must be a 1-D integer tensor")
        return [int(v) for v in group_sizes.tolist()]
    return [int(v) for v in group_sizes]


def _weights(weight: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The per-group weights: the slices of one [groups, K, N] tensor, or the tensors given."""
    if torch.is_tensor(weight):
        if weight.dim() != 3:
            raise ValueError(
                f"{_OP}: a weight tensor must be [groups, K, N], got {tuple(weight.shape)}"
            )
        return list(weight.unbind(0))
    return list(weight)


def _check(x: torch.Tensor, weights: list[torch.Tensor], sizes: list[int], trans_b: bool) -> None:
    check_float_dtype(_OP, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{_OP}: x must be [M, K], got {tuple(x.shape)}")
    if len(sizes) != len(weights):
        raise ValueError(f"{_OP}: {len(sizes)} group sizes for {len(weights)} weights")
    for g, w in enumerate(weights):
        check_float_dtype(_OP, f"weight {g}", w)
        check_same_dtype(_OP, ("x", f"weight {g}"), (x, w))
        if w.dim() != 2 or w.shape != weights[0].shape:
            raise ValueError(
                f"{_OP}: weight {g} is {tuple(w.shape)}; every group's weight must "
                f"be 2-D and of one shape"
            )
    k = weights[0].shape[1] if trans_b else weights[0].shape[0]
    if x.shape[1] != k:
        raise ValueError(
            f"{_OP}: x has {x.shape[1]} columns but each weight has {k} input rows "
            f"(trans_b={trans_b})"
        )
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(
            f"{_OP}: group sizes {sizes} must be >= 0 and sum to the {x.shape[0]} rows of x"
        )


def native_grouped_mm(x: torch.Tensor, weight, group_sizes, trans_b: bool = False) -> torch.Tensor:
    """One ``torch.mm`` per group (autograd through torch); each group's weight is used as a
    slice of its own, so the backward writes one weight gradient per group, no more."""
    sizes, weights = _sizes(group_sizes), _weights(weight)
    _check(x, weights, sizes, trans_b)
    parts = [
        torch.mm(rows, w.t() if trans_b else w)
        for rows, w in zip(torch.split(x, sizes, dim=0), weights, strict=True)
    ]
    return torch.cat(parts, dim=0)


class _NpuGroupedMatmul(torch.autograd.Function):
    """``weights`` is one [groups, K, N] tensor or one [K, N] tensor per group (possibly
    transposed views): the kernel takes either form, so nothing is stacked or copied."""

    @staticmethod
    def forward(ctx, kernels, group_list, x, *weights):
        ctx.kernels = kernels
        ctx.save_for_backward(group_list, x, *weights)
        return kernels.npu_grouped_matmul(
            [x],
            list(weights),
            group_list=group_list,
            split_item=3,
            group_type=0,
            group_list_type=1,
        )[0]

    @staticmethod
    def backward(ctx, grad_out):
        kernels = ctx.kernels
        group_list, x, *weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = None
        grad_weights: tuple = (None,) * len(weights)
        if ctx.needs_input_grad[2]:
            grad_x = kernels.npu_grouped_matmul(
                [grad_out],
                [w.transpose(-1, -2) for w in weights],
                group_list=group_list,
                split_item=3,
                group_type=0,
                group_list_type=1,
            )[0]
        if any(ctx.needs_input_grad[3:]):
            stacked = kernels.npu_grouped_matmul(
                [x.t().contiguous()],
                [grad_out],
                group_list=group_list,
                split_item=3,
                group_type=2,
                group_list_type=1,
            )[0]  # [groups, K, N]: x_g^T dy_g for every group at once
            one_tensor = len(weights) == 1 and weights[0].dim() == 3
            grad_weights = (stacked,) if one_tensor else tuple(stacked.unbind(0))
        return (None, None, grad_x, *grad_weights)


def npu_grouped_mm(
    kernels: ModuleType, x: torch.Tensor, weight, group_sizes, trans_b: bool = False
) -> torch.Tensor:
    """One ``npu_grouped_matmul`` per direction (forward, input gradient, weight gradient)."""
    sizes, weights = _sizes(group_sizes), _weights(weight)
    _check(x, weights, sizes, trans_b)
    group_list = torch.tensor(sizes, dtype=torch.int64, device=x.device)
    if torch.is_tensor(weight):
        operands = [weight.transpose(1, 2) if trans_b else weight]
    else:
        operands = [w.t() if trans_b else w for w in weight]
    return _NpuGroupedMatmul.apply(kernels, group_list, x.contiguous(), *operands)


def grouped_mm(x: torch.Tensor, weight, group_sizes, trans_b: bool = False) -> torch.Tensor:
    """``x[rows of g] @ weight[g]`` for every group ``g``, on the NPU kernel when one is in use.
    ``weight`` is one [groups, K, N] tensor or a list of [K, N] tensors ([N, K] with
    ``trans_b``)."""
    kernels = npu_kernels("npu_grouped_matmul")
    if kernels is not None:
        return npu_grouped_mm(kernels, x, weight, group_sizes, trans_b)
    return native_grouped_mm(x, weight, group_sizes, trans_b)
