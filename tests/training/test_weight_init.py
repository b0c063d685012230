"""Megatron's device init path fills each TP shard with exactly the host path's slice.

The host path is Megatron's own ``_initialize_affine_weight_cpu`` (master drawn whole, sliced per
rank); the device path is what ``_initialize_affine_weight_gpu`` does -- set the shard's TP
attributes, then call ``init_method`` on the shard -- with the wrapped init method.
"""

from __future__ import annotations

import functools

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    set_tensor_model_parallel_attributes,
)

from megatron_npu.training import weight_init
from megatron_npu.training.weight_init import LayoutIndependentInit, wrap_init_methods

NORMAL = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
OUT, IN, WORLD = 12, 8, 2


@pytest.fixture
def tp_rank(monkeypatch):
    """Set the (tensor-parallel rank, world size) both paths read."""

    def set_rank(rank: int, world: int) -> None:
        for module in (parallel_state, layers):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: world)

    return set_rank


def _host(dim: int, stride: int, rank: int, seed: int) -> torch.Tensor:
    shape = [OUT, IN]
    shape[dim] //= WORLD
    weight = torch.empty(shape)
    weight_init.reseed(seed)
    _initialize_affine_weight_cpu(
        weight, OUT, IN, shape[dim], dim, LayoutIndependentInit(NORMAL), stride=stride
    )
    return weight


def _device(dim: int, stride: int, rank: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    shape = [OUT, IN]
    shape[dim] //= WORLD
    shard = torch.empty(shape, dtype=dtype)
    set_tensor_model_parallel_attributes(tensor=shard, is_parallel=True, dim=dim, stride=stride)
    weight_init.reseed(seed)
    LayoutIndependentInit(NORMAL)(shard)
    return shard


@pytest.mark.parametrize("dim,stride", [(0, 1), (0, 2), (1, 1), (1, 2)])
def test_device_shard_is_the_host_slice(tp_rank, dim, stride):
    shards = []
    for rank in range(WORLD):
        tp_rank(rank, WORLD)
        host, device = _host(dim, stride, rank, seed=7), _device(dim, stride, rank, seed=7)
        assert torch.equal(host, device), (rank, dim, stride)
        shards.append(device)
    assert not torch.equal(shards[0], shards[1])  # each rank got its own slice
    # the shards are slices of one N(0, 0.02) master: together they have its spread
    assert 0.01 < float(torch.cat(shards).std()) < 0.03


def test_tp1_shard_is_the_whole_master(tp_rank):
    tp_rank(0, 1)
    shard = torch.empty(OUT, IN)
    set_tensor_model_parallel_attributes(tensor=shard, is_parallel=True, dim=0, stride=1)
    weight_init.reseed(3)
    LayoutIndependentInit(NORMAL)(shard)
    whole = torch.empty(OUT, IN)
    weight_init.reseed(3)
    LayoutIndependentInit(NORMAL)(whole)
    assert torch.equal(shard, whole)


def test_draws_come_from_the_stream_not_the_cpu_generator(tp_rank):
    tp_rank(0, 1)
    weight_init.reseed(5)
    first = LayoutIndependentInit(NORMAL)(torch.empty(4, 4)).clone()
    second = LayoutIndependentInit(NORMAL)(torch.empty(4, 4)).clone()
    assert not torch.equal(first, second)  # the stream advances from one draw to the next
    weight_init.reseed(5)
    torch.manual_seed(999)  # anything else drawing from the CPU generator changes nothing
    torch.rand(100)
    again = LayoutIndependentInit(NORMAL)(torch.empty(4, 4))
    assert torch.equal(first, again)


def test_16_bit_shard_is_the_rounded_fp32_master(tp_rank):
    """The host path draws an fp32 master and casts it; the device path rounds the same way."""
    tp_rank(1, WORLD)
    device = _device(0, 1, 1, seed=11, dtype=torch.bfloat16)
    assert device.dtype == torch.bfloat16
    assert torch.equal(device, _host(0, 1, 1, seed=11).to(torch.bfloat16))


def test_wrap_init_methods_wraps_each_method_once():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    wrap_init_methods(config)
    wrap_init_methods(config)
    for name in ("init_method", "output_layer_init_method"):
        method = getattr(config, name)
        assert isinstance(method, LayoutIndependentInit)
        assert not isinstance(method.inner, LayoutIndependentInit)


def test_a_gated_fc1_unmarked_by_megatron_is_cut_with_stride_2(tp_rank):
    """megatron-core up to 0.15 leaves a SwiGLU FC1's ``partition_stride`` at 1 although each
    TP rank holds [its gate rows; its up rows]: drawn as a gated FC1, the unmarked shard equals
    the stride-2 slice of the master (what 0.16+ marks), and the TP2 shards put the gate and the
    up halves back in the master's order."""
    shards = {}
    for rank in range(WORLD):
        tp_rank(rank, WORLD)
        marked = _device(0, 2, rank, seed=5)
        with weight_init.gated_fc1():
            unmarked = _device(0, 1, rank, seed=5)
        assert torch.equal(unmarked, marked), rank
        shards[rank] = unmarked
    half = OUT // WORLD // 2  # each rank: half of its rows gate, half up
    gate = torch.cat([shards[r][:half] for r in range(WORLD)])
    up = torch.cat([shards[r][half:] for r in range(WORLD)])
    tp_rank(0, 1)
    weight_init.reseed(5)
    full = torch.empty(OUT, IN)
    LayoutIndependentInit(NORMAL)(full)
    assert torch.equal(torch.cat([gate, up]), full)
