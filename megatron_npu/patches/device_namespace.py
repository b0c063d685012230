"""Route ``torch.cuda.*`` and ``device="cuda"`` in the Megatron modules that use them.

Each entry replaces one module's ``torch`` global with
:data:`megatron_npu.devices.torch_namespace.TORCH_NAMESPACE`; only code in that module sees it.
The list holds the modules a GPT pretraining run (TP/SP/PP/DP, distributed optimizer,
dist-checkpointing) executes that call ``torch.cuda`` or create tensors on ``"cuda"``.
"""

from __future__ import annotations

from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE
from megatron_npu.registry import Patch

MODULES = (
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.optimizer",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.timers",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
)

#: modules whose routing a parity case exercises on real process groups (the rest are exempt)
_PARITY = {
    "megatron.core.pipeline_parallel.p2p_communication": "parity.cases.communication:P2P",
    "megatron.core.tensor_parallel.mappings": "parity.cases.communication:TP_MAPPINGS",
}
_EXEMPT = "device routing, no numerics of its own"
_EXEMPT_TEST = "tests/patches/test_device_namespace.py::test_module_torch_routes_cuda_to_the_active_device"

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
        exempt_test="" if module in _PARITY else (
            f"{_EXEMPT_TEST}[torch-namespace:{module.removeprefix('megatron.core.')}]"
        ),
    )
    for module in MODULES
]
