"""Plumbing patches without numerics of their own (their parity exemptions point here): each
test fails with its patch disabled (``MEGATRON_NPU_DISABLE=<id>``, as the coverage gate runs
it).

* ``scope.fp16-optimizer-init`` / ``scope.distopt-init`` / ``scope.distopt-param-groups``:
  Megatron's mixed-precision and distributed optimizers check ``param.type()`` against
  ``torch.cuda.*`` names while they are built;
* ``checkpoint.writer-process-memory``: the torch_dist writer asks for its RSS through psutil,
  which need not be installed;
* ``checkpoint.common-state-optimizer-classes``: ``--optimizer-cpu-offload``'s checkpoints hold
  optimizer classes in their common state, which torch's ``weights_only`` load refuses.
"""

from __future__ import annotations

import sys

import pytest
import torch


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


def _pickled_as(module: str, name: str) -> type:
    """A class that pickles by reference as ``module.name`` (a module this machine may lack)."""
    return type(name, (), {"__module__": module, "__qualname__": name})


def test_common_state_with_offload_optimizer_classes_loads(cpu_adaptor, tmp_path, monkeypatch):
    """A HybridDeviceOptimizer checkpoint's common state, as written here (torch's AdamW on the
    host, Megatron's Adam on the device) and on a GPU cluster (Transformer Engine's FusedAdam,
    apex's FusedSGD, modules absent here), loads through megatron-core's common-state loader:
    each recorded class reads as the class that serves it here. Any other global is still
    refused."""
    import types

    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    foreign, stand_ins = {}, []
    for module, name in (
        ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam"),
        ("apex.optimizers.fused_sgd", "FusedSGD"),
    ):
        foreign[name] = _pickled_as(module, name)
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):  # pickle imports the module and its packages
            stand_in = ".".join(parts[:depth])
            monkeypatch.setitem(sys.modules, stand_in, types.ModuleType(stand_in))
            stand_ins.append(stand_in)
        setattr(sys.modules[module], name, foreign[name])
    groups = [
        {"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": megatron_optimizer.Adam},
        {"cpu_optimizer_cls": torch.optim.SGD, "gpu_optimizer_cls": foreign["FusedAdam"]},
        {"cpu_optimizer_cls": torch.optim.SGD, "gpu_optimizer_cls": foreign["FusedSGD"]},
    ]
    for name, state in (("ours", groups[:1]), ("cluster", groups[1:])):
        (tmp_path / name).mkdir()
        torch.save({"optimizer": {"param_groups": state}}, tmp_path / name / "common.pt")
    for stand_in in stand_ins:  # as on this machine: neither is installed
        monkeypatch.delitem(sys.modules, stand_in)

    loader = TorchCommonLoadStrategy()
    ours = loader.load_common(tmp_path / "ours")["optimizer"]["param_groups"]
    cluster = loader.load_common(tmp_path / "cluster")["optimizer"]["param_groups"]
    assert ours == groups[:1]
    assert [(g["cpu_optimizer_cls"], g["gpu_optimizer_cls"]) for g in cluster] == [
        (torch.optim.SGD, megatron_optimizer.Adam),
        (torch.optim.SGD, megatron_optimizer.SGD),
    ]

    (tmp_path / "code").mkdir()
    torch.save({"hook": sys.exit}, tmp_path / "code" / "common.pt")
    with pytest.raises(Exception, match="sys.exit"):
        loader.load_common(tmp_path / "code")
