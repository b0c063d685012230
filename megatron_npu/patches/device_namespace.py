"""Route ``torch.cuda.*`` and ``device="cuda"`` in the Megatron modules that use them.

Each entry replaces one module's ``torch`` global with
:data:`megatron_npu.devices.torch_namespace.TORCH_NAMESPACE`; only code in that module sees it.
Which modules: derived, not hand-kept. :func:`megatron_npu.devices.cuda_scan.cuda_using_modules`
scans the installed megatron-core's sources for CUDA uses, and every such module under
:data:`ROUTED` (what GPT pretraining with TP/SP/PP/DP, the distributed optimizer and
dist-checkpointing imports) is routed, unless :data:`NOT_ROUTED` says why not. A CUDA-using module
that is neither (a new Megatron module, say) fails ``tests/test_device_routing_scan.py``.
"""

from __future__ import annotations

from megatron_npu.devices.cuda_scan import classify, cuda_using_modules
from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE
from megatron_npu.registry import Patch

#: Megatron packages and modules whose CUDA uses are routed (GPT pretraining's import closure).
ROUTED = (
    "megatron.core.datasets",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.fp8_utils",
    "megatron.core.models.common",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel",
    "megatron.core.timers",
    "megatron.core.transformer",
    "megatron.core.utils",
)

_GPU_ONLY = "GPU-only machinery with no NPU/CPU counterpart the adaptor provides"
#: CUDA-using Megatron code left unrouted, and why (a package covers every module under it; the
#: more specific of a ROUTED and a NOT_ROUTED entry wins).
NOT_ROUTED = {
    "megatron.core.inference": "inference engines and servers: the adaptor covers training",
    "megatron.core.export": f"TensorRT-LLM export: {_GPU_ONLY}",
    "megatron.core.resharding": f"NCCL/NVSHMEM weight-resharding services: {_GPU_ONLY}",
    "megatron.core.nccl_allocator": f"NCCL user-buffer allocator: {_GPU_ONLY}",
    "megatron.core.energy_monitor": f"NVML energy counters: {_GPU_ONLY}",
    "megatron.core.full_cuda_graph": f"CUDA graphs: {_GPU_ONLY}",
    "megatron.core.transformer.cuda_graphs": f"CUDA graphs: {_GPU_ONLY}",
    "megatron.core.extensions.transformer_engine": "TransformerEngine layers (CUDA-only): the "
    "adaptor runs the local layer spec",
    "megatron.core.fusions": "Triton/TransformerEngine fused kernels: the adaptor replaces the GPT "
    "entry points (activation, softmax, rotary, cross-entropy patches) instead",
    "megatron.core.transformer.custom_layers.batch_invariant_kernels": "Triton kernels (needs "
    "triton, CUDA-only)",
    "megatron.core.ssm": "Mamba / gated-delta-net layers: outside the GPT scope",
    "megatron.core.models.bert": "BERT: outside the GPT scope",
    "megatron.core.distributed.distributed_data_parallel_config": "names 'cuda' only in "
    "documentation; no CUDA call to route",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config": "names "
    "'cuda' only in documentation; no CUDA call to route",
}

#: The routed modules: the scan's, classified (see the module docstring).
MODULES = tuple(classify(cuda_using_modules("megatron.core"), ROUTED, NOT_ROUTED)[0])

#: modules whose routing a parity case exercises on real process groups (the rest are exempt)
_PARITY = {
    "megatron.core.pipeline_parallel.p2p_communication": (
        "megatron_npu.parity.cases.communication:P2P"
    ),
    "megatron.core.tensor_parallel.mappings": "megatron_npu.parity.cases.communication:TP_MAPPINGS",
}
_EXEMPT = "device routing, no numerics of its own"
_EXEMPT_TEST = (
    "tests/patches/test_device_namespace.py::test_module_torch_routes_cuda_to_the_active_device"
)

PATCHES = [
    Patch(
        id=f"torch-namespace:{module.removeprefix('megatron.core.')}",
        target=f"{module}.torch",
        replacement=TORCH_NAMESPACE,
        reason="torch.cuda and device='cuda' in this module go to the active device",
        versions=">=0.13",
        check_signature=False,
        rebind_copies=False,
        parity=_PARITY.get(module),
        parity_exempt="" if module in _PARITY else _EXEMPT,
        benchmark_exempt="device-namespace plumbing: its per-call cost is "
        "perf/test_device_routing_bench.py",
        exempt_test=""
        if module in _PARITY
        else (f"{_EXEMPT_TEST}[torch-namespace:{module.removeprefix('megatron.core.')}]"),
    )
    for module in MODULES
]
