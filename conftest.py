"""Shared pytest fixtures: the adaptor applied per test, and a one-rank gloo world."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

import megatron_npu

pytest_plugins = ["megatron_npu.parity.plugin"]


@pytest.fixture
def cpu_adaptor() -> Iterator[None]:
    """The adaptor applied for the CPU for one test, restored afterwards."""
    megatron_npu.apply("cpu")
    try:
        yield
    finally:
        megatron_npu.restore()


@pytest.fixture(autouse=True)
def _no_leaked_patches() -> Iterator[None]:
    """Every test starts and ends with the adaptor restored."""
    megatron_npu.restore()
    yield
    megatron_npu.restore()


@pytest.fixture(scope="session")
def gloo_world_of_one() -> Iterator[None]:
    """torch.distributed with one gloo rank and Megatron's model-parallel groups of size 1."""
    from megatron.core import parallel_state

    store_dir = tempfile.mkdtemp(prefix="megatron-npu-store-")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{os.path.join(store_dir, 'store')}", rank=0, world_size=1
        )
    # Megatron's group creation asks the device layer for the current device.
    megatron_npu.apply("cpu")
    try:
        parallel_state.initialize_model_parallel(1, 1)
    finally:
        megatron_npu.restore()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    shutil.rmtree(store_dir, ignore_errors=True)  # the rendezvous file: nothing left in /tmp
