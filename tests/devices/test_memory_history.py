"""torch.cuda's allocator-history calls on torch_npu (with a stand-in torch.npu that records what
it is asked): torch's legacy boolean form reaches torch_npu in the keyword form it takes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_npu.devices.memory_history import NpuMemoryHistory, keyword_form
from megatron_npu.devices.npu import NpuAccelerator


@pytest.mark.parametrize(
    ("call", "form"),
    [
        # Megatron-LM's model provider (--record-memory-history)
        (
            ((True,), {"trace_alloc_max_entries": 100000, "trace_alloc_record_context": True}),
            {"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": 100000},
        ),
        # torch's legacy defaults: the live state with its stacks, no alloc/free trace
        (
            ((True,), {}),
            {"enabled": "state", "context": "state", "stacks": "python", "max_entries": 1},
        ),
        (
            ((True, False, 50, False, None, True), {}),
            {"enabled": "all", "context": None, "stacks": "all", "max_entries": 50},
        ),
        (((False,), {"trace_alloc_max_entries": 100000}), {"enabled": None}),
        # the keyword form passes as it is
        (
            (("all",), {"context": "all", "max_entries": 7}),
            {"enabled": "all", "context": "all", "max_entries": 7},
        ),
        (
            (("state", "alloc", "python"), {}),
            {"enabled": "state", "context": "alloc", "stacks": "python"},
        ),
        (((None,), {}), {"enabled": None}),
    ],
)
def test_legacy_calls_read_as_torch_reads_them(call, form):
    args, kwargs = call
    assert keyword_form(*args, **kwargs) == form


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def function(self, name: str, result=None):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return result

        return record


def _torch_npu(recorder: _Recorder, *, with_observer: bool = True):
    memory = SimpleNamespace(
        _record_memory_history=recorder.function("record"),
        _snapshot=recorder.function("snapshot", {"segments": ["npu"], "device_traces": [[]]}),
        _dump_snapshot=recorder.function("dump"),
    )
    c = SimpleNamespace()
    if with_observer:
        c._npu_attach_out_of_memory_observer = recorder.function("observer")
    return SimpleNamespace(memory=memory), c


def test_the_npu_accelerator_hands_the_calls_to_torch_npu():
    recorder = _Recorder()
    npu, c = _torch_npu(recorder)
    history = NpuAccelerator(npu, c).memory_history
    history._record_memory_history(
        True, trace_alloc_max_entries=100000, trace_alloc_record_context=True
    )
    observer = object()
    history.attach_out_of_memory_observer(observer)
    assert history._snapshot() == {"segments": ["npu"], "device_traces": [[]]}
    history._dump_snapshot("snapshot.pickle")
    assert recorder.calls == [
        (
            "record",
            (),
            {"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": 100000},
        ),
        ("observer", (observer,), {}),
        ("snapshot", (), {}),
        ("dump", ("snapshot.pickle",), {}),
    ]


def test_a_torch_npu_without_the_hook_is_one_named_error_when_asked():
    npu, c = _torch_npu(_Recorder(), with_observer=False)
    history = NpuMemoryHistory(npu, c)  # building the device does not need it
    with pytest.raises(RuntimeError, match="_npu_attach_out_of_memory_observer.*--record-memory"):
        history.attach_out_of_memory_observer(print)


def test_cuda_keeps_torchs_own_history(monkeypatch):
    """On ``cuda`` (transparent mode leaves it alone) train's calls reach torch's own functions,
    legacy form and all (stand-ins recording the calls: there is no GPU here)."""
    import torch

    from megatron_npu.devices import memory_history
    from megatron_npu.devices.cpu import CpuAccelerator

    recorder = _Recorder()
    for name in ("_record_memory_history", "_snapshot", "_dump_snapshot"):
        monkeypatch.setattr(torch.cuda.memory, name, recorder.function(name))
    monkeypatch.setattr(
        torch._C,
        "_cuda_attach_out_of_memory_observer",
        recorder.function("observer"),
        raising=False,
    )
    history = memory_history.of(SimpleNamespace(accelerator=torch.cuda))
    history._record_memory_history(True, trace_alloc_max_entries=5)
    history.attach_out_of_memory_observer(print)
    history._dump_snapshot("s.pickle")
    assert recorder.calls == [
        ("_record_memory_history", (True,), {"trace_alloc_max_entries": 5}),
        ("observer", (print,), {}),
        ("_dump_snapshot", ("s.pickle",), {}),
    ]
    # the other devices' accelerators carry their own
    cpu = CpuAccelerator()
    assert memory_history.of(SimpleNamespace(accelerator=cpu)) is cpu.memory_history
