"""Megatron-LM's ``--record-memory-history`` for ``megatron-npu train``.

As Megatron-LM does: every rank records the allocator's history (alloc/free events with their
Python stacks, 100,000 kept) from before the model is built, and attaches an out-of-memory
observer that writes that rank's snapshot; the last rank pickles a snapshot to
``--memory-snapshot-path`` at each logged step. The calls go to the device's allocator history
(:mod:`megatron_npu.devices.memory_history`): torch's on ``cuda``, torch_npu's on ``npu``, and
on a host device, which keeps none, one line says so and the snapshots hold no segments.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_npu.devices import memory_history

#: alloc/free events kept, Megatron-LM's figure
TRACE_ENTRIES = 100_000


def oom_snapshot_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its snapshot when the allocator runs out of memory
    (Megatron-LM 0.19's naming: ``BASE_oom_rank-R.EXT`` beside the snapshot)."""
    base, ext = os.path.splitext(path)
    return f"{base}_oom_rank-{rank}{ext}"


class MemorySnapshots:
    """One rank's ``--record-memory-history``: created before the model is built, told each
    step the loop logs."""

    def __init__(self, args: Any, device: Any, rank: int, world_size: int) -> None:
        self.path = args.memory_snapshot_path if args.record_memory_history else None
        self.rank = rank
        self.dumps = rank == world_size - 1  # Megatron-LM's last rank
        if self.path is None:
            return
        self.history = memory_history.of(device)
        self.history._record_memory_history(
            True, trace_alloc_max_entries=TRACE_ENTRIES, trace_alloc_record_context=True
        )
        self.history.attach_out_of_memory_observer(self._out_of_memory)

    def _out_of_memory(self, *_: Any) -> None:
        self.history._dump_snapshot(oom_snapshot_path(self.path, self.rank))

    def logged(self) -> None:
        """A step was logged: the last rank writes the snapshot."""
        if self.path is not None and self.dumps:
            self.history._dump_snapshot(self.path)
