"""Device RNG state behind Megatron's model-parallel RNG tracker.

Megatron's stock ``_set_cuda_rng_state`` defers through ``torch.cuda._lazy_call``, which on a
machine without CUDA queues the call forever: the tracker's ``fork()`` then silently keeps the
default state and dropout is not reproducible. These replacements set and read the active device's
generator at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch

from megatron_npu import devices
from megatron_npu.devices.facts import CPU, NPU_EMULATED
from megatron_npu.registry import Patch

_RANDOM = "megatron.core.tensor_parallel.random"
_EXEMPT = "RNG plumbing, no numerics of its own: the named test checks the generator directly"
_TESTS = "tests/patches/test_rng.py::"


def _device_generator() -> torch.Generator:
    return devices.require_active().accelerator.default_generators[0]


def _get_cuda_rng_state(
    device: int | str | torch.device = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor | torch.Generator:
    """The active device's RNG state: a fresh tensor, or with ``graph_safe`` (Megatron's
    ``use_cudagraphable_rng`` tracker) a generator holding a copy of it (``clone`` is implied)."""
    if graph_safe:
        return _device_generator().clone_state()
    return devices.require_active().accelerator.get_rng_state()


def _set_cuda_rng_state(
    new_state: torch.Tensor | torch.Generator, device: int = -1, graph_safe: bool = False
):
    """Set the active device's RNG state immediately (no lazy CUDA call); ``graph_safe`` states
    are generators, whose state is copied in."""
    if graph_safe:
        new_state = new_state.get_state()
    devices.require_active().accelerator.set_rng_state(new_state)


class _DropSharedGeneratorWarning(logging.Filter):
    """On a CPU device the device generator *is* the CPU generator, so Megatron's warning that
    the CPU RNG state changed inside ``fork()`` is always true and means nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _wrap_fork(original: Any) -> Any:
    @functools.wraps(original)
    @contextlib.contextmanager
    def fork(self: Any, *args: Any, **kwargs: Any):
        logger = logging.getLogger(_RANDOM)
        quiet = _DropSharedGeneratorWarning()
        logger.addFilter(quiet)
        try:
            with original(self, *args, **kwargs):
                yield
        finally:
            logger.removeFilter(quiet)

    return fork


PATCHES = [
    Patch(
        id="rng.get-state",
        target=f"{_RANDOM}._get_cuda_rng_state",
        replacement=_get_cuda_rng_state,
        reason="read the active device's generator instead of torch.cuda.default_generators",
        versions=">=0.13",
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_TESTS + "test_get_state_reads_the_device_generator",
    ),
    Patch(
        id="rng.set-state",
        target=f"{_RANDOM}._set_cuda_rng_state",
        replacement=_set_cuda_rng_state,
        reason="stock version queues a lazy CUDA call that never runs without CUDA",
        versions=">=0.13",
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_TESTS + "test_set_state_takes_effect_at_once",
    ),
    Patch(
        id="rng.fork-shared-generator",
        target=f"{_RANDOM}.CudaRNGStatesTracker.fork",
        replacement=_wrap_fork,
        kind="wrap",
        reason="device and CPU generator are one on a CPU device: drop the always-true warning",
        versions=">=0.13",
        devices=frozenset({CPU, NPU_EMULATED}),
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_TESTS + "test_fork_keeps_quiet_on_a_shared_generator",
    ),
]
