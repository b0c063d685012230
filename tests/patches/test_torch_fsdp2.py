"""``--use-torch-fsdp2``: Megatron's ``TorchFullyShardedDataParallel`` shards on the active device,
the fused AdamW updates FSDP2's DTensor shards as it updates plain parameters, and what fails in
Megatron's own FSDP2 code is refused by name exactly where it fails."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from megatron_npu.ops.adamw import flat_view
from megatron_npu.optim.adamw import FusedAdamW
from megatron_npu.patches import torch_fsdp2


def _tiny_megatron_module():
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True
    )

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.first = torch.nn.Linear(8, 8)
            self.second = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    return config, Tiny()


def test_torch_fsdp2_wraps_megatrons_model_on_the_active_device(gloo_world_of_one, cpu_adaptor):
    """Megatron builds the mesh with ``DeviceMesh.from_group(group, "cuda")``; here it is cpu's,
    the parameters are DTensor shards on it, and a step's gradients are FSDP2's."""
    from megatron.core.distributed import (
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
    )

    config, module = _tiny_megatron_module()
    torch.manual_seed(0)
    plain = {name: p.detach().clone() for name, p in module.named_parameters()}
    model = TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(), module)
    assert model.device_mesh.device_type == "cpu"
    params = dict(model.module.named_parameters())
    assert params and all(isinstance(p, DTensor) for p in params.values())
    assert all(torch.equal(p.full_tensor(), plain[name]) for name, p in params.items())
    model(torch.ones(2, 8)).sum().backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.device.type == "cpu" for p in params.values())


def _dtensor_pair(mesh, shapes):
    torch.manual_seed(1)
    plain = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    sharded = [
        torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain
    ]
    return plain, sharded


def _steps(optimizer, params, grads, steps):
    for step in range(steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g(step)
        optimizer.step()


def test_fused_adamw_updates_dtensor_shards_as_plain_parameters(gloo_world_of_one):
    """Four steps, a state-dict round trip between them: the DTensor parameters end bitwise where
    the plain ones do, and their moments are DTensors of the same placements whose shards lie
    back to back in one buffer (one kernel call on the NPU)."""
    from torch.distributed import DeviceMesh

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    shapes = [(4, 3), (5,), (2, 2, 2)]
    plain, sharded = _dtensor_pair(mesh, shapes)
    grads = [
        lambda step, s=s, i=i: torch.full(s, 0.1 * (i + 1)) * (step - 1.5)
        for i, s in enumerate(shapes)
    ]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    ours = FusedAdamW(plain, **kwargs)
    theirs = FusedAdamW(sharded, **kwargs)
    _steps(ours, plain, grads, 2)
    _steps(
        theirs,
        sharded,
        [lambda k, g=g: distribute_tensor(g(k), mesh, [Shard(0)]) for g in grads],
        2,
    )
    resumed = FusedAdamW(sharded, **kwargs)
    resumed.load_state_dict(theirs.state_dict())
    _steps(ours, plain, [lambda k, g=g: g(k + 2) for g in grads], 2)
    _steps(
        resumed,
        sharded,
        [lambda k, g=g: distribute_tensor(g(k + 2), mesh, [Shard(0)]) for g in grads],
        2,
    )
    for p, q in zip(plain, sharded, strict=True):
        assert torch.equal(p.detach(), q.full_tensor())
        for key in ("exp_avg", "exp_avg_sq"):
            moment = resumed.state[q][key]
            assert isinstance(moment, DTensor) and moment.placements == q.placements
            assert torch.equal(moment.full_tensor(), ours.state[p][key])
    for key in ("exp_avg", "exp_avg_sq"):
        assert flat_view([resumed.state[q][key].to_local() for q in sharded]) is not None


def _args(**options):
    return SimpleNamespace(**{"use_torch_fsdp2": True, "save": None, "load": None, **options})


def test_a_refused_release_is_one_whose_fsdp2_step_fails():
    """The refusal names the installed release exactly when Megatron's ``finalize_model_grads``
    makes a call (read from its source) that ``finish_grad_sync``'s signature cannot bind."""
    import inspect

    from megatron.core.distributed import TorchFullyShardedDataParallel, finalize_model_grads

    calls = "finish_grad_sync(force_all_reduce=" in inspect.getsource(finalize_model_grads)
    try:
        inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).bind(
            object(), force_all_reduce=False
        )
        binds = True
    except TypeError:
        binds = False
    refused = [p for p in torch_fsdp2.problems(_args()) if "finish_grad_sync" in p]
    assert bool(refused) == (calls and not binds), (refused, calls, binds)


def _get_model_as_megatron_lm_0_13():
    """Megatron-LM core_v0.13's ``get_model`` wraps each model chunk so."""
    return DP(module=None, disable_bucketing=False)  # noqa: F821 - source only, never called


def test_a_get_model_the_wrapper_cannot_take_is_refused(monkeypatch):
    """Megatron-LM's ``get_model`` (read from its source) passes ``disable_bucketing``: refused
    exactly when the installed ``TorchFullyShardedDataParallel`` cannot bind it."""
    import inspect
    from types import ModuleType

    from megatron.core.distributed import TorchFullyShardedDataParallel

    training = ModuleType("megatron.training.training")
    training.get_model = _get_model_as_megatron_lm_0_13
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    try:
        inspect.signature(TorchFullyShardedDataParallel.__init__).bind(
            object(), config=None, ddp_config=None, module=None, disable_bucketing=False
        )
        binds = True
    except TypeError:
        binds = False
    refused = [p for p in torch_fsdp2.problems(_args()) if "disable_bucketing" in p]
    assert bool(refused) == (not binds), (refused, binds)
    monkeypatch.delitem(sys.modules, "megatron.training.training")
    assert not [p for p in torch_fsdp2.problems(_args()) if "disable_bucketing" in p]


@pytest.mark.parametrize("option", ["save", "load"])
def test_checkpoints_with_fsdp2_are_refused_by_name(option):
    found = torch_fsdp2.problems(_args(**{option: "/ckpt"}))
    assert [p for p in found if p.startswith("--save/--load with --use-torch-fsdp2:")]
    assert torch_fsdp2.problems(SimpleNamespace(use_torch_fsdp2=False, save="/ckpt")) == []
