"""Megatron-LM's ``--record-memory-history`` in ``megatron-npu train``: every rank records from
before the model is built, the last rank pickles a snapshot at each logged step, an allocator
out-of-memory event writes that rank's own."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from megatron_npu.training.memory_snapshots import MemorySnapshots, oom_snapshot_path

from ._runner import TINY, train


class _History:
    """A device's allocator history that records what it is asked."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.observer = None

    def _record_memory_history(self, *args, **kwargs) -> None:
        self.calls.append(("record", args, kwargs))

    def attach_out_of_memory_observer(self, observer) -> None:
        self.observer = observer

    def _dump_snapshot(self, filename: str) -> None:
        self.calls.append(("dump", filename))


def _snapshots(rank: int, world: int, record: bool = True):
    history = _History()
    device = SimpleNamespace(accelerator=SimpleNamespace(memory_history=history))
    args = SimpleNamespace(record_memory_history=record, memory_snapshot_path="out/snap.pickle")
    return MemorySnapshots(args, device, rank, world), history


def test_every_rank_records_as_megatron_lm_asks_and_the_last_one_dumps():
    first, first_history = _snapshots(0, 2)
    last, last_history = _snapshots(1, 2)
    megatron_lm_call = ("record", (True,), {
        "trace_alloc_max_entries": 100_000, "trace_alloc_record_context": True,
    })  # fmt: skip
    assert first_history.calls == last_history.calls == [megatron_lm_call]
    first.logged()
    last.logged()
    assert first_history.calls == [megatron_lm_call]
    assert last_history.calls == [megatron_lm_call, ("dump", "out/snap.pickle")]
    # an out-of-memory event: the rank's own snapshot beside the others
    first_history.observer(0, 1 << 30, 1 << 34, 0)
    assert first_history.calls[-1] == ("dump", "out/snap_oom_rank-0.pickle")


def test_without_the_option_nothing_is_asked():
    snapshots, history = _snapshots(1, 2, record=False)
    snapshots.logged()
    assert history.calls == [] and history.observer is None


def test_out_of_memory_snapshots_sit_beside_the_snapshot():
    assert oom_snapshot_path("runs/a.pickle", 3) == "runs/a_oom_rank-3.pickle"
    assert oom_snapshot_path("snapshot", 0) == "snapshot_oom_rank-0"


def test_a_host_run_writes_empty_snapshots_and_says_why_once(tmp_path):
    """Two ranks on cpu, logged at steps 2 and 3: the last rank's snapshot is torch's format
    with nothing in it, and one line (not one per rank) says the host keeps no history."""
    snapshot = tmp_path / "snapshot.pickle"
    run = train(
        tmp_path,
        *TINY,
        "--train-iters", "3", "--log-interval", "2",
        "--record-memory-history", "--memory-snapshot-path", str(snapshot),
        nproc=2,
    )  # fmt: skip
    with open(snapshot, "rb") as f:
        assert pickle.load(f) == {"segments": [], "device_traces": [[]]}
    said = [line for line in run.stdout.splitlines() if "memory history" in line]
    assert said == [
        "megatron-npu: the cpu device has no caching allocator, so memory history records "
        "nothing; its snapshots hold no segments and no trace events"
    ]
