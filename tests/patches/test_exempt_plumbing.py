"""Plumbing patches without numerics of their own (their parity exemptions point here): each
test fails with its patch disabled (``MEGATRON_NPU_DISABLE=<id>``, as the coverage gate runs
it).

* ``scope.fp16-optimizer-init`` / ``scope.distopt-init`` / ``scope.distopt-param-groups``:
  Megatron's mixed-precision and distributed optimizers check ``param.type()`` against
  ``torch.cuda.*`` names while they are built;
* ``checkpoint.writer-process-memory``: the torch_dist writer asks for its RSS through psutil,
  which need not be installed;
* ``checkpoint.common-state-optimizer-classes`` (and its ``-in-load-common`` and
  ``-in-load-common-state-dict`` siblings, one per release's common-state loader):
  ``--optimizer-cpu-offload``'s checkpoints hold optimizer classes in their common state, which
  torch's ``weights_only`` load refuses.
"""

from __future__ import annotations

import sys

import pytest
import torch
from pickled_elsewhere import install_module, registered_elsewhere

from megatron_npu.patcher import megatron_core_below


def _megatron_optimizer(**options):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    half = {"bf16": True} if options.get("bf16") else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True, **half
    )

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(8, 8, dtype=torch.bfloat16 if half else None)

    distributed = options.get("use_distributed_optimizer", False)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), Tiny()
    )
    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, **options), [model])


@pytest.mark.parametrize(
    "options",
    [{"bf16": True}, {"use_distributed_optimizer": True, "bf16": True}],
    ids=["float16-optimizer", "distributed-optimizer"],
)
def test_megatron_optimizers_build_on_cpu(options, gloo_world_of_one, cpu_adaptor):
    optimizer = _megatron_optimizer(**options)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])  # 0.16 chains param groups
    kind = "DistributedOptimizer" if options.get("use_distributed_optimizer") else "Float16"
    assert any(kind in type(o).__name__ for o in inner), [type(o).__name__ for o in inner]


def test_writer_process_memory_without_psutil(cpu_adaptor, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    assert filesystem_async._process_memory() > 0


#: The classes Transformer Engine's and apex's fused optimizers pickle as (checkpoints of a GPU
#: cluster whose Megatron had them), and which of Megatron's optimizer names serves each here.
_FUSED = [
    ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam", "Adam"),
    ("transformer_engine.pytorch.optimizers.fused_sgd", "FusedSGD", "SGD"),
    ("apex.optimizers.fused_adam", "FusedAdam", "Adam"),
    ("apex.optimizers.fused_sgd", "FusedSGD", "SGD"),
]


@pytest.mark.skipif(
    megatron_core_below("0.14"),
    reason="megatron-core 0.13 loads common.pt with weights_only=False: nothing is refused there",
)
def test_common_state_with_offload_optimizer_classes_loads(cpu_adaptor, tmp_path, monkeypatch):
    """A HybridDeviceOptimizer checkpoint's common state, as written here (torch's AdamW on the
    host, Megatron's Adam on the device) and on GPU clusters (Transformer Engine's and apex's
    fused optimizers), loads through megatron-core's common-state loader: a recorded class whose
    module is not loaded reads as the class that serves it here, one that is loaded as itself.
    Any other global is still refused, and a global registered before stays registered."""
    import pickle

    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    def save(name: str, common: dict) -> None:
        (tmp_path / name).mkdir()
        save_config(CheckpointingConfig("torch_dist"), str(tmp_path / name))
        torch.save(common, tmp_path / name / "common.pt")

    def load(name: str) -> dict:
        return load_common_state_dict(str(tmp_path / name))

    groups = [
        {"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": megatron_optimizer.Adam}
    ]
    save("ours", {"optimizer": {"param_groups": groups}})
    with monkeypatch.context() as installed:
        fused = [install_module(installed, module, name) for module, name, _ in _FUSED]
        groups = [{"cpu_optimizer_cls": torch.optim.SGD, "gpu_optimizer_cls": c} for c in fused]
        save("cluster", {"optimizer": {"param_groups": groups}})
    save("code", {"hook": sys.exit})
    with registered_elsewhere(torch.optim.AdamW):
        ours = load("ours")["optimizer"]["param_groups"]
        cluster = load("cluster")["optimizer"]["param_groups"]
        assert torch.optim.AdamW in torch.serialization.get_safe_globals()
    assert (ours[0]["cpu_optimizer_cls"], ours[0]["gpu_optimizer_cls"]) == (
        torch.optim.AdamW,
        megatron_optimizer.Adam,
    )
    serves = [getattr(megatron_optimizer, name) for _, _, name in _FUSED]
    assert [g["gpu_optimizer_cls"] for g in cluster] == serves
    assert {g["cpu_optimizer_cls"] for g in cluster} == {torch.optim.SGD}

    loaded = install_module(monkeypatch, _FUSED[0][0], _FUSED[0][1])
    cluster = load("cluster")["optimizer"]["param_groups"]
    assert cluster[0]["gpu_optimizer_cls"] is loaded  # a loaded module's class is itself

    with pytest.raises(pickle.UnpicklingError, match="sys.exit"):
        load("code")
