"""Mixture of Experts: what megatron-core's MoE layers reach beyond plain torch.

megatron-core's router computes its gating logits through ``moe_utils.te_general_gemm``. Up to
megatron-core 0.16 that name is bound only when Transformer Engine imports, so without TE the
first MoE forward stops with ``NameError``; from 0.17 it is ``None`` and Megatron falls back to
``torch.mm``. The adaptor binds it on every release to :func:`megatron_npu.ops.gemm.general_gemm`
(TE's contract: output in the router dtype), so the router runs the same code on every release.

With ``--moe-grouped-gemm`` the experts' GEMMs go through the grouped GEMM
(:func:`megatron_npu.ops.grouped_matmul.grouped_mm`, ``npu_grouped_matmul`` on the NPU). Up to
megatron-core 0.16 the local spec's ``GroupedMLP`` calls it as ``grouped_gemm.ops.gmm`` (the
``grouped_gemm`` CUDA package, absent here): the adaptor binds that package's place in
``grouped_gemm_util`` to :data:`GROUPED_GEMM`.

The alltoall dispatcher reads its split sizes on the host: ``maybe_move_tensor_to_cpu`` moves a
tensor there only when ``tensor.is_cuda``, which is False for an NPU tensor and for a CPU one, so
the sizes would stay tensors and ``all_to_all_single`` rejects them. The replacement moves any
device tensor and converts to numpy whenever asked.

With ``--moe-permute-fusion`` the dispatchers call ``permute`` / ``unpermute`` /
``sort_chunks_by_idxs`` with ``fused=True``, which Megatron serves only through TE. The wrapped
functions serve it on the NPU with torch_npu's routing-map kernels
(:mod:`megatron_npu.ops.moe_permute`: one call per permutation, never one per expert) and
elsewhere with Megatron's own unfused code, which computes the same rows. The chunk sort has no
torch_npu kernel and runs Megatron's unfused code everywhere. TransformerConfig accepts the
option only when ``moe_utils`` holds TE's five fused names, so the adaptor binds those too, each
to the served function in TE's calling convention.

With ``--moe-router-fusion`` the router asks for TE's fused top-k and aux-loss scores
(``fused=True``). The wrapped ``topk_routing_with_score_function`` serves the top-k on the NPU
with ``npu_moe_gating_top_k`` where its routing is Megatron's
(:mod:`megatron_npu.ops.moe_router`), and with Megatron's unfused code otherwise; the aux-loss
scores and the load-balancing loss have no torch_npu kernel and run Megatron's unfused code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE
from megatron_npu.ops.gemm import general_gemm
from megatron_npu.ops.grouped_matmul import grouped_mm
from megatron_npu.ops.kernels import npu_kernels
from megatron_npu.ops.moe_permute import (
    KERNEL_INDEX_DTYPE,
    kernel_num_out_tokens,
    kernel_takes_probs,
    permute_with_kernel,
    unpermute_with_kernel,
)
from megatron_npu.ops.moe_router import gating_kernel_groups, npu_sigmoid_top_k
from megatron_npu.registry import Patch

_UTILS = "megatron.core.transformer.moe.moe_utils"
_GG = "megatron.core.transformer.moe.grouped_gemm_util"


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: Any, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``: ``a`` [tokens, K] in runs of ``batch_sizes`` rows, ``b``
    [experts, K, N] (``[experts, N, K]`` with ``trans_b``)."""
    return grouped_mm(a, b, batch_sizes, trans_b=trans_b)


#: what ``grouped_gemm_util`` sees as the ``grouped_gemm`` package
GROUPED_GEMM = ModuleType("grouped_gemm", "megatron-npu: the grouped GEMM on this device")
GROUPED_GEMM.ops = SimpleNamespace(gmm=gmm)


def maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """``tensor`` on the host (numpy when ``as_numpy``), from whichever device it is on; anything
    that is not a tensor comes back unchanged. ``record_stream`` keeps a device tensor alive for
    the side stream that copied it, as on CUDA."""
    if not torch.is_tensor(tensor):
        return tensor
    on_device = tensor.device.type != "cpu"
    host = tensor.to(torch.device("cpu"), non_blocking=True) if on_device else tensor
    if as_numpy:
        host = host.numpy()
    if record_stream and on_device:
        tensor.record_stream(TORCH_NAMESPACE.cuda.current_stream())
    return host


def fused_permute_wrap(original: Callable) -> Callable:
    """``moe_utils.permute`` whose ``fused=True`` runs the NPU permute kernel where one is in use
    and its contract holds, and Megatron's unfused code otherwise. From megatron-core 0.17 the
    function also takes ``tokens_per_expert`` / ``align_size`` and returns five values (the last
    two: pad offsets, None when nothing was padded, and ``tokens_per_expert``)."""
    five = "align_size" in inspect.signature(original).parameters

    def permute(
        tokens,
        routing_map,
        probs=None,
        num_out_tokens=None,
        fused=False,
        drop_and_pad=False,
        **more,
    ):
        kernels = npu_kernels("npu_moe_token_permute_with_routing_map") if fused else None
        out_tokens = (
            None
            if kernels is None or not kernel_takes_probs(tokens, probs)
            else kernel_num_out_tokens(routing_map, num_out_tokens, drop_and_pad)
        )
        if out_tokens is None:
            return original(
                tokens,
                routing_map,
                probs=probs,
                num_out_tokens=num_out_tokens,
                fused=False,
                drop_and_pad=drop_and_pad,
                **more,
            )
        done = permute_with_kernel(kernels, tokens, routing_map, probs, out_tokens, drop_and_pad)
        return (*done, None, more.get("tokens_per_expert")) if five else done

    permute.__wrapped__ = original
    return permute


def fused_unpermute_wrap(original: Callable) -> Callable:
    """``moe_utils.unpermute`` that sums back through the NPU unpermute kernel the rows the
    permute kernel made (an int32 index map), and through Megatron's unfused code otherwise."""

    def unpermute(
        permuted_tokens,
        sorted_indices,
        restore_shape,
        probs=None,
        routing_map=None,
        fused=False,
        drop_and_pad=False,
        **more,
    ):
        kernels = npu_kernels("npu_moe_token_unpermute_with_routing_map") if fused else None
        if kernels is not None and sorted_indices.dtype == KERNEL_INDEX_DTYPE:
            return unpermute_with_kernel(
                kernels,
                permuted_tokens,
                sorted_indices,
                restore_shape,
                probs,
                routing_map,
                drop_and_pad,
            )
        return original(
            permuted_tokens,
            sorted_indices,
            restore_shape,
            probs=probs,
            routing_map=routing_map,
            fused=False,
            drop_and_pad=drop_and_pad,
            **more,
        )

    unpermute.__wrapped__ = original
    return unpermute


def fused_top_k_wrap(original: Callable) -> Callable:
    """``moe_utils.topk_routing_with_score_function`` whose ``fused=True`` runs the NPU gating
    kernel where its routing is Megatron's, and Megatron's unfused code otherwise."""

    def topk_routing_with_score_function(
        logits,
        topk,
        use_pre_softmax=False,
        num_groups=None,
        group_topk=None,
        scaling_factor=None,
        score_function="softmax",
        expert_bias=None,
        fused=False,
        **more,
    ):
        kernels = (
            npu_kernels("npu_moe_gating_top_k", "npu_moe_gating_top_k_backward") if fused else None
        )
        groups = None
        if kernels is not None and not any(v is not None and v is not False for v in more.values()):
            groups = gating_kernel_groups(logits, topk, score_function, num_groups, group_topk)
        if groups is not None:
            return npu_sigmoid_top_k(kernels, logits, topk, expert_bias, groups, scaling_factor)
        return original(
            logits,
            topk,
            use_pre_softmax=use_pre_softmax,
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=scaling_factor,
            score_function=score_function,
            expert_bias=expert_bias,
            fused=False,
            **more,
        )

    topk_routing_with_score_function.__wrapped__ = original
    return topk_routing_with_score_function


def unfused_wrap(original: Callable) -> Callable:
    """``original`` with ``fused=True`` served by its own unfused code (no torch_npu kernel)."""

    def unfused(*args, fused=False, **kwargs):
        return original(*args, fused=False, **kwargs)

    unfused.__wrapped__ = original
    unfused.__name__ = unfused.__qualname__ = original.__name__
    unfused.__doc__ = original.__doc__
    return unfused


def _utils() -> ModuleType:
    import importlib

    return importlib.import_module(_UTILS)


def te_fused_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1):
    """TE's ``moe_permute`` (mask map): (permuted tokens, index map)."""
    out = _utils().permute(inp, routing_map, num_out_tokens=_count(num_out_tokens), fused=True)
    return out[0], out[2]


def te_fused_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
    """TE's ``moe_permute_with_probs``: (permuted tokens, permuted probs, index map)."""
    out = _utils().permute(
        inp, routing_map, probs=probs, num_out_tokens=_count(num_out_tokens), fused=True
    )
    return out[0], out[1], out[2]


def te_fused_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, **_):
    """TE's ``moe_unpermute`` without merging probs (the dispatchers apply the probs before);
    merging probs need the routing map, which TE's signature does not carry."""
    if merging_probs is not None:
        raise ValueError(
            "megatron-npu: fused_unpermute with merging_probs needs the routing "
            "map: call moe_utils.unpermute(..., probs=, routing_map=, fused=True)"
        )
    return _utils().unpermute(inp, row_id_map, restore_shape, fused=True)


def te_fused_sort_chunks_by_index(inp, split_sizes, sorted_index):
    return _utils().sort_chunks_by_idxs(inp, split_sizes, sorted_index, fused=True)[0]


def te_fused_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index):
    return _utils().sort_chunks_by_idxs(inp, split_sizes, sorted_index, probs=probs, fused=True)


def _count(num_out_tokens: Any) -> Any:
    return None if num_out_tokens is None or int(num_out_tokens) < 0 else num_out_tokens


#: TE's fused permutation names, as ``moe_utils`` imports them when TE is present
TE_FUSED_PERMUTATION = {
    "fused_permute": te_fused_permute,
    "fused_permute_with_probs": te_fused_permute_with_probs,
    "fused_unpermute": te_fused_unpermute,
    "fused_sort_chunks_by_index": te_fused_sort_chunks_by_index,
    "fused_sort_chunks_by_index_with_probs": te_fused_sort_chunks_by_index_with_probs,
}


#: the two kernels work as a pair (the permute's index map means something to the unpermute
#: only), so each patch's parity case runs both and each declares both
PERMUTATION_KERNELS = (
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute_with_routing_map",
)


PATCHES = [
    Patch(
        id="moe.router-gating-gemm",
        target=f"{_UTILS}.te_general_gemm",
        replacement=general_gemm,
        creates=True,
        check_signature=False,
        reason="the router's gating GEMM (RouterGatingLinearFunction), bound only when TE imports "
        "(a NameError without TE up to megatron-core 0.16)",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.moe:ROUTER_GATING",
        benchmark="perf.cases.moe:ROUTER_GATING",
    ),
    Patch(
        id="moe.host-split-sizes",
        target=f"{_UTILS}.maybe_move_tensor_to_cpu",
        replacement=maybe_move_tensor_to_cpu,
        reason="the alltoall dispatcher's split sizes reach the host from any device (Megatron "
        "moves only CUDA tensors: on an NPU or the CPU all_to_all_single gets tensors)",
        versions=">=0.13",
        parity_exempt="moves tensors to the host, no numerics of its own",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_moe_trains[ep2-alltoall]",
        benchmark_exempt="a host copy of a few split sizes per dispatch",
    ),
    Patch(
        id="moe.grouped-gemm",
        target=f"{_GG}.grouped_gemm",
        replacement=GROUPED_GEMM,
        creates=True,
        check_signature=False,
        versions="<0.17",
        reason="the local spec's GroupedMLP (--moe-grouped-gemm) finds a grouped GEMM package",
        parity_exempt="binds a name: its ops.gmm is moe.grouped-gemm-ops",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_moe_trains[local-grouped-gemm]",
        benchmark_exempt="binds a name: the GEMM is benchmarked as moe.grouped-gemm-ops",
    ),
    Patch(
        id="moe.grouped-gemm-ops",
        target=f"{_GG}.ops",
        replacement=GROUPED_GEMM.ops,
        creates=True,
        check_signature=False,
        versions="<0.17",
        reason="GroupedMLP's gg.ops.gmm -> one npu_grouped_matmul per direction",
        parity="megatron_npu.parity.cases.moe:GROUPED_GEMM",
        benchmark="perf.cases.moe:GROUPED_GEMM",
        npu_kernels=("npu_grouped_matmul",),
    ),
    Patch(
        id="moe.fused-permute",
        target=f"{_UTILS}.permute",
        kind="wrap",
        replacement=fused_permute_wrap,
        check_signature=False,
        versions=">=0.13",
        reason="--moe-permute-fusion: the dispatchers' fused permutation (TE-only in Megatron) -> "
        "one npu_moe_token_permute_with_routing_map call",
        parity="megatron_npu.parity.cases.moe:TOKEN_PERMUTATION",
        benchmark="perf.cases.moe:TOKEN_PERMUTATION",
        npu_kernels=PERMUTATION_KERNELS,
    ),
    Patch(
        id="moe.fused-unpermute",
        target=f"{_UTILS}.unpermute",
        kind="wrap",
        replacement=fused_unpermute_wrap,
        check_signature=False,
        versions=">=0.13",
        reason="--moe-permute-fusion: the fused sum back per token -> one "
        "npu_moe_token_unpermute_with_routing_map call",
        parity="megatron_npu.parity.cases.moe:TOKEN_PERMUTATION",
        benchmark="perf.cases.moe:TOKEN_PERMUTATION",
        npu_kernels=PERMUTATION_KERNELS,
    ),
    Patch(
        id="moe.fused-sort-chunks",
        target=f"{_UTILS}.sort_chunks_by_idxs",
        kind="wrap",
        replacement=unfused_wrap,
        check_signature=False,
        versions=">=0.13",
        reason="--moe-permute-fusion: the alltoall dispatcher's fused chunk sort (TE-only) runs "
        "Megatron's unfused sort (torch_npu has no chunk-sort kernel; the split sizes may stay "
        "on the device)",
        # the whole MoE layer's case: a single-rank alltoall layer with several local experts
        # sorts its chunks, so it fails without this entry, and it exercises every MoE entry
        parity="megatron_npu.parity.cases.moe:MOE_LAYER",
        benchmark="perf.cases.moe:MOE_LAYER_STEP",
    ),
    Patch(
        id="moe.fused-router-top-k",
        target=f"{_UTILS}.topk_routing_with_score_function",
        kind="wrap",
        replacement=fused_top_k_wrap,
        check_signature=False,
        versions=">=0.14",
        reason="--moe-router-fusion: the router's fused top-k (TE-only in Megatron) -> "
        "npu_moe_gating_top_k forward and backward where its routing is Megatron's",
        parity="megatron_npu.parity.cases.moe:ROUTER_TOP_K",
        benchmark="perf.cases.moe:ROUTER_TOP_K",
        npu_kernels=("npu_moe_gating_top_k", "npu_moe_gating_top_k_backward"),
    ),
    *(
        Patch(
            id=f"moe.unfused-{name.replace('_', '-')}",
            target=f"{_UTILS}.{name}",
            kind="wrap",
            replacement=unfused_wrap,
            check_signature=False,
            versions=">=0.14",
            reason=f"--moe-router-fusion: the fused {what} (TE-only) runs Megatron's unfused "
            "code (torch_npu has no such kernel)",
            parity_exempt="calls Megatron's own unfused code: no numerics of its own",
            exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_moe_trains[allgather-capacity]",
            benchmark_exempt="Megatron's own code, unchanged",
        )
        for name, what in (
            ("compute_routing_scores_for_aux_loss", "aux-loss routing scores"),
            ("switch_load_balancing_loss_func", "load-balancing loss"),
        )
    ),
    *(
        Patch(
            id=f"moe.te-{name.replace('_', '-')}",
            target=f"{_UTILS}.{name}",
            replacement=function,
            creates=True,
            check_signature=False,
            versions=">=0.13",
            reason=f"TransformerConfig accepts --moe-permute-fusion only when moe_utils.{name} "
            "is bound (TE only)",
            parity_exempt="TE's calling convention over moe.fused-permute / moe.fused-unpermute",
            exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_moe_trains[te-grouped-gemm]",
            benchmark_exempt="forwards to the benchmarked permutation",
        )
        for name, function in TE_FUSED_PERMUTATION.items()
    ),
]
