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
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE
from megatron_npu.ops.gemm import general_gemm
from megatron_npu.ops.grouped_matmul import grouped_mm
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
]
