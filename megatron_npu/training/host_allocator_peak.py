"""The allocator peak of a training step on the host (``cpu`` and ``npu-emulated``).

torch keeps allocator statistics for its accelerators (``torch.cuda.max_memory_allocated``,
``torch.npu.max_memory_allocated``) but none for the CPU, where the process's resident set is
all there is: it counts the interpreter, the libraries and pages the allocator has not returned,
so it is not the same measure as a cuda or npu row's peak. This module gives the host rows the
same measure, from torch's own profiler:

* **live bytes at the step's start**: the bytes of every distinct tensor storage the process
  holds (parameters, gradient buffers, optimizer state, cached data), found through the garbage
  collector and counted once per storage;
* **the step's net allocation peak**: with ``profile_memory=True`` the CPU allocator reports
  every allocation and free it serves while profiling is on; the running sum of those sizes in
  time order peaks where the step held the most on top of what it started with.

The sum is the step's allocator peak. A block allocated before profiling started and freed
during the step is not reported by the profiler (torch warns "Memory block of unknown size was
allocated before the profiling started"), so the figure can only overstate the true peak by such
blocks, never understate it; Megatron's gradient buffers and parameters live for the whole run
and are not freed in a step. The training loop measures the first step it runs (a warm-up step,
left out of every s/step statistic): the step that also creates the optimizer's state.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: the ``peak_memory_source`` of a metrics file whose host peak was measured here
SOURCE = "torch.profiler (profile_memory): live tensor storages + the step's net CPU allocations"


def live_storage_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable from Python objects."""
    sizes: dict[int, int] = {}
    with warnings.catch_warnings():
        # isinstance() on torch.distributed's deprecated reduce_op object warns once
        warnings.filterwarnings("ignore", message=".*reduce_op.*", category=FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        try:
            if tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # meta, sparse or functional tensors hold no CPU storage of their own
        pointer = storage.data_ptr()
        if pointer:
            sizes[pointer] = max(sizes.get(pointer, 0), storage.nbytes())
    return sum(sizes.values())


def net_allocation_peak(profiler: torch.profiler.profile) -> int:
    """The highest running total of the CPU allocations and frees the profiler saw, in time
    order (0 when nothing was allocated)."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    running = peak = 0
    for _, size in sorted(events, key=lambda event: event[0]):
        running += size
        peak = max(peak, running)
    return peak


@dataclass
class HostPeak:
    """What :func:`measure` found (bytes); ``peak_bytes`` is set when the block ends."""

    live_bytes: int = 0
    net_peak_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.live_bytes + self.net_peak_bytes


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null: libkineto writes a ``USDT: ... profiler_start`` /
    ``profiler_stop`` line there on every start and stop, whatever its log level, which would
    land in the user's training log once per rank. Only the start and stop are silenced."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def measure() -> Iterator[HostPeak]:
    """Measure the allocator peak of the block (one training step) on the host."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler.*")
        result = HostPeak(live_bytes=live_storage_bytes())
        with _stderr_silenced():
            profiler.__enter__()
        try:
            yield result
        finally:
            with _stderr_silenced():
                profiler.__exit__(None, None, None)
    result.net_peak_bytes = net_allocation_peak(profiler)
