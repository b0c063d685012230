"""Cost of the device routing installed in Megatron's modules (no TorchFunctionMode is used).

Compares, per call, a tensor factory and an attribute lookup through the module-scoped torch
namespace against plain torch. Run: ``pytest perf --benchmark-only``.
"""

from __future__ import annotations

import pytest
import torch

import megatron_npu
from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE


@pytest.fixture
def applied():
    megatron_npu.apply("cpu")
    yield
    megatron_npu.restore()


@pytest.mark.benchmark(group="routing-factory")
def test_plain_torch_empty(benchmark):
    benchmark.extra_info.update(device="cpu", what="torch.empty(16)")
    benchmark(torch.empty, 16)


@pytest.mark.benchmark(group="routing-factory")
def test_routed_empty_cuda(benchmark, applied):
    benchmark.extra_info.update(device="cpu", what="namespace.empty(16, device='cuda')")
    benchmark(lambda: TORCH_NAMESPACE.empty(16, device="cuda"))


@pytest.mark.benchmark(group="routing-factory")
def test_plain_torch_empty_lambda(benchmark):
    benchmark.extra_info.update(device="cpu", what="lambda: torch.empty(16, device='cpu')")
    benchmark(lambda: torch.empty(16, device="cpu"))


@pytest.mark.benchmark(group="apply-restore")
def test_apply_then_restore(benchmark):
    """``apply("cpu")`` + ``restore()`` once, the whole registry (target: under 50 ms)."""
    megatron_npu.apply("cpu")  # first call imports Megatron's modules: not part of the figure
    megatron_npu.restore()
    benchmark.extra_info.update(
        patch_id=None,
        op="apply-restore",
        path="native",
        device="cpu",
        emulated=False,
        direction="step",
        peak_memory_bytes=None,
    )
    benchmark.pedantic(
        lambda: (megatron_npu.apply("cpu"), megatron_npu.restore()),
        rounds=10,
        iterations=1,
        warmup_rounds=1,
    )


@pytest.mark.benchmark(group="routing-attribute")
def test_plain_attribute(benchmark):
    benchmark(lambda: torch.matmul)


@pytest.mark.benchmark(group="routing-attribute")
def test_routed_attribute(benchmark, applied):
    benchmark(lambda: TORCH_NAMESPACE.matmul)  # read from torch at each use
