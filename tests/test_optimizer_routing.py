"""get_megatron_optimizer builds megatron-npu's fused AdamW on cpu (without apex/TE)."""

from __future__ import annotations

import megatron_npu
from megatron_npu.optim.adamw import FusedAdamW


def _build_optimizer():
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True
    )

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(8, 8)

    model = DistributedDataParallel(config, DistributedDataParallelConfig(), Tiny())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    return opt.optimizer


def test_megatron_optimizer_is_the_fused_adamw_when_applied(gloo_world_of_one, cpu_adaptor):
    assert isinstance(_build_optimizer(), FusedAdamW)


def test_without_the_adaptor_megatron_would_use_torch_adamw(gloo_world_of_one):
    import torch

    megatron_npu.apply("cpu")
    megatron_npu.restore()
    from megatron.core import optimizer

    assert optimizer.torch is torch
