"""Plumbing patches without numerics of their own (their parity exemptions point here): each
test fails with its patch disabled (``MEGATRON_NPU_DISABLE=<id>``, as the coverage gate runs
it).

* ``scope.fp16-optimizer-init`` / ``scope.distopt-init`` / ``scope.distopt-param-groups``:
  Megatron's mixed-precision and distributed optimizers check ``param.type()`` against
  ``torch.cuda.*`` names while they are built;
* ``checkpoint.writer-process-memory``: the torch_dist writer asks for its RSS through psutil,
  which need not be installed.
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
