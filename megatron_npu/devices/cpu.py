"""The CPU as Megatron's device: gloo process groups and the CPU default generator.

:class:`CpuAccelerator` answers the ``torch.cuda`` calls Megatron makes. On a CPU the "device
generator" *is* torch's default CPU generator, so RNG state get/set/seed act on it; streams and
events are synchronous no-ops that keep timing; memory figures are the process's resident set.
"""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace
from typing import Any

import torch

from megatron_npu.devices import host_memory
from megatron_npu.devices.base import Device, NoNvtx
from megatron_npu.devices.facts import CPU
from megatron_npu.devices.memory_history import HostMemoryHistory


class CpuStream:
    """A stream on a synchronous device: every operation has completed when it returns."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return hash(CpuStream)


class CpuEvent:
    """An event that records wall-clock time; ``elapsed_time`` is in milliseconds like CUDA's."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: CpuEvent) -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end._time - self._time) * 1000.0


_DEFAULT_STREAM = CpuStream()


class CpuGraph:
    """``torch.cuda.CUDAGraph`` on a device that never captures graphs.

    Megatron's graph-safe RNG tracker (``CudaRNGStatesTracker(use_cudagraphable_rng=True)``) only
    checks that graphs can register generator states; with no capture there is nothing to
    register, so that is accepted. Capturing or replaying has no meaning here and is refused with
    a message saying what to turn off.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.generator_states: list[Any] = []

    def register_generator_state(self, state: Any) -> None:
        self.generator_states.append(state)

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "CUDA graph capture/replay is not available on a CPU device: run without CUDA "
            "graphs (Megatron's --cuda-graph-impl none / enable_cuda_graph=False)"
        )

    capture_begin = capture_end = replay = reset = pool = _refuse


class CpuAccelerator:
    """The ``torch.cuda``-shaped API for a CPU device (only what Megatron uses)."""

    name = CPU
    nvtx = NoNvtx()
    Stream = CpuStream
    Event = CpuEvent
    CUDAGraph = CpuGraph

    def __init__(self) -> None:
        self.random = SimpleNamespace(
            get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state
        )
        self.default_generators = (torch.default_generator,)
        #: ``--record-memory-history``'s calls: the host allocator keeps no history
        self.memory_history = HostMemoryHistory(self.name)

    # --- device selection -------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _lazy_init(self) -> None:
        return None

    def device_count(self) -> int:
        return 1

    def current_device(self) -> torch.device:
        # A torch.device (not CUDA's int) so ``.to(torch.cuda.current_device())`` and
        # ``device=torch.cuda.current_device()`` in Megatron land on the CPU unpatched.
        return torch.device("cpu")

    def set_device(self, device: Any) -> None:
        return None

    def device(self, device: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        return None

    # --- RNG --------------------------------------------------------------------------------
    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def seed(self) -> None:
        torch.default_generator.seed()

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()

    # --- streams ----------------------------------------------------------------------------
    def current_stream(self, device: Any = None) -> CpuStream:
        return _DEFAULT_STREAM

    def default_stream(self, device: Any = None) -> CpuStream:
        return _DEFAULT_STREAM

    def stream(self, stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def set_stream(self, stream: Any) -> None:
        return None

    def is_current_stream_capturing(self) -> bool:
        return False

    # --- memory -----------------------------------------------------------------------------
    def memory_allocated(self, device: Any = None) -> int:
        return host_memory.rss_bytes()

    def max_memory_allocated(self, device: Any = None) -> int:
        return host_memory.peak_rss_bytes()

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        host_memory.reset_peak()

    reset_max_memory_allocated = reset_peak_memory_stats

    def empty_cache(self) -> None:
        return None

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        total = host_memory.total_bytes()
        return max(total - host_memory.rss_bytes(), 0), total

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        # the keys of torch.cuda.memory_stats() that Megatron-LM's TensorBoard logging reads;
        # a host process has one "allocation" (its resident set) and reserves what it holds
        current, peak = self.memory_allocated(), self.max_memory_allocated()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
            "allocation.all.current": 1,
        }

    # --- properties -------------------------------------------------------------------------
    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        # (0, 0): below every CUDA capability gate, so Megatron never picks a CUDA-only kernel.
        return (0, 0)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(
            name="cpu",
            major=0,
            minor=0,
            total_memory=host_memory.total_bytes(),
            multi_processor_count=os.cpu_count() or 1,
        )

    # --- health readings (NVML's on CUDA; Megatron's straggler detector reports them) ---------
    # A host CPU has no such sensors here: 0 means "not measured", as NVML reports an
    # unsupported reading, so a straggler report never shows an invented value.
    def temperature(self, device: Any = None) -> int:
        return 0

    def power_draw(self, device: Any = None) -> int:
        return 0

    def utilization(self, device: Any = None) -> int:
        return 0

    def clock_rate(self, device: Any = None) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"megatron-npu's {self.name} device layer has no answer for torch.cuda.{name}; "
            "Megatron reached a CUDA API the adaptor does not cover yet (please report it)"
        )


def make_device() -> Device:
    return Device.of(CPU, CpuAccelerator())
