"""The ``rng.*`` patches (their parity exemption points here): the model-parallel RNG tracker's
device state is read and set at once on a CUDA-less device, and fork() on a device whose
generator is the CPU's does not warn that the CPU state changed. Each test fails with its
patch disabled (``MEGATRON_NPU_DISABLE``; run so by tests/parity/test_coverage_gate.py)."""

from __future__ import annotations

import logging

import torch


def test_get_state_reads_the_device_generator(cpu_adaptor, monkeypatch):
    """Read through the active device itself, not through the module's ``torch`` global (which
    the torch-namespace entry of the same module also routes: that one alone would hide a
    missing get-state patch on 0.16, so the module sees the real torch here)."""
    from megatron.core.tensor_parallel import random

    monkeypatch.setattr(random, "torch", torch)
    torch.manual_seed(3)
    assert torch.equal(random._get_cuda_rng_state(), torch.get_rng_state())


def test_set_state_takes_effect_at_once(cpu_adaptor):
    from megatron.core.tensor_parallel import random

    torch.manual_seed(5)
    state = torch.get_rng_state()
    first = torch.rand(4)
    random._set_cuda_rng_state(state)  # the stock version queues a lazy CUDA call instead
    assert torch.equal(torch.rand(4), first)


def test_fork_keeps_quiet_on_a_shared_generator(gloo_world_of_one, cpu_adaptor, caplog):
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(11)
    with caplog.at_level(logging.DEBUG, logger="megatron.core.tensor_parallel.random"):
        with get_cuda_rng_tracker().fork():
            torch.rand(8)
    assert "CPU RNG state changed" not in caplog.text
