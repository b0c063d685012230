"""Transparent mode (``apply(device, transfer=True)``): user code's CUDA spellings reach the device,
``restore()`` puts every rebound name back, and without ``transfer`` nothing process-wide moves."""

from __future__ import annotations

import inspect
import sys
import textwrap
import types

import pytest
import torch

import megatron_npu
from megatron_npu import transfer
from megatron_npu.devices.base import Device
from megatron_npu.devices.cpu import CpuAccelerator

_ABSENT = object()
#: namespaces transparent mode may touch; each is compared name by name before and after
NAMESPACES = {
    "torch": torch,
    "torch.cuda": torch.cuda,
    "torch.cuda.random": torch.cuda.random,
    "torch.cuda.memory": torch.cuda.memory,
    "torch._C": torch._C,
    "torch.Tensor": torch.Tensor,
    "torch.nn.Module": torch.nn.Module,
    "torch.distributed": torch.distributed,
    "torch.accelerator": torch.accelerator,
}


def _snapshot() -> dict[str, dict[str, object]]:
    """Every name in :data:`NAMESPACES`, taken after one apply/restore cycle so the imports it
    triggers (torch._dynamo rebinds ``torch.manual_seed`` when first imported) have happened."""
    megatron_npu.apply("cpu", transfer=True)
    megatron_npu.restore()
    return {name: dict(vars(ns)) for name, ns in NAMESPACES.items()}


def _changes(before: dict[str, dict[str, object]]) -> list[str]:
    """Names rebound since ``before`` (submodules imported meanwhile are not rebinds)."""
    changed = []
    for name, ns in NAMESPACES.items():
        now = vars(ns)
        for key in set(now) | set(before[name]):
            old, new = before[name].get(key, _ABSENT), now.get(key, _ABSENT)
            if old is _ABSENT and isinstance(new, types.ModuleType):
                continue
            if new is not old:
                changed.append(f"{name}.{key}")
    return sorted(changed)


@pytest.mark.parametrize("device", ["cpu", "npu-emulated"])
def test_user_code_cuda_spellings_reach_the_device(device, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    before = _snapshot()
    megatron_npu.apply(device, transfer=True)
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2
    assert torch.cuda.current_device() == 1  # CUDA's numbering: this rank's index
    torch.cuda.set_device(0)
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device("cuda:1")
    assert torch.cuda.current_device() == 1
    cpu = torch.device("cpu")
    assert torch.device("cuda") == cpu and torch.device("cuda", 1) == cpu
    assert torch.device(type="cuda") == cpu and isinstance(torch.device("cuda"), torch.device)
    assert torch.zeros(2, device="cuda").device == cpu
    assert torch.empty(1, device=torch.device("cuda:1")).device == cpu
    assert torch.ones(2).cuda().device == cpu and torch.ones(2).to("cuda").device == cpu
    assert torch.ones(2).to(0).device == cpu
    assert torch.ones(2).to("cuda", torch.float16).dtype == torch.float16
    assert torch.ones(2).to(torch.float64).dtype == torch.float64
    assert torch.ones(2).to(device="cuda:0").device == cpu
    module = torch.nn.Linear(2, 2).cuda().to("cuda")
    assert module.weight.device == cpu
    # RNG: the CUDA generator is the device's generator
    torch.cuda.manual_seed(7)
    first = torch.rand(4)
    state = torch.cuda.get_rng_state()
    second = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), second)
    assert torch.equal(torch.rand(4, generator=torch.Generator().manual_seed(7)), first)
    assert torch.cuda.random.get_rng_state().equal(torch.get_rng_state())
    # streams, events and memory answer without CUDA
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.synchronize()
    end.record()
    assert start.elapsed_time(end) >= 0
    assert torch.cuda.memory_allocated() > 0 and torch.cuda.max_memory_allocated() > 0
    assert not torch.cuda.is_current_stream_capturing()
    megatron_npu.restore()
    assert _changes(before) == [], "restore() left names rebound"
    assert not torch.cuda.is_available()  # the CPU wheel's own answer again


@pytest.mark.parametrize("device", ["cpu", "npu-emulated"])
def test_a_cuda_builds_accelerator_keeps_cudas_own_answer(device, monkeypatch):
    """torch built for CUDA (PyPI's default on Linux) on a machine without a usable GPU:
    ``torch.accelerator`` is CUDA's, and torch's optimizers ask it for the current stream before
    each step (the graph-capture check) once it says it is available, which it asks
    ``torch.cuda.is_available()``. With transparent mode on another device that answers for the
    active device, so the stream call would reach the CUDA runtime; ``torch.accelerator`` keeps
    CUDA's own answer (here: none), ``torch.cuda`` the device's."""
    before = _snapshot()
    cuda_here = torch.cuda.is_available()
    monkeypatch.setattr(torch._C, "_accelerator_getAccelerator", lambda: torch.device("cuda"))
    megatron_npu.apply(device, transfer=True)
    try:
        assert torch.cuda.is_available()
        assert torch.accelerator.is_available() is cuda_here
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        optimizer = torch.optim.Adam([param], lr=0.1)
        optimizer.step()  # the graph-capture check, as Megatron's host optimizers take it
        assert torch.allclose(param.detach(), torch.full((3,), 0.9))
    finally:
        megatron_npu.restore()
    monkeypatch.undo()
    assert _changes(before) == []


@pytest.mark.parametrize("device", ["cpu", "npu-emulated"])
def test_memory_history_calls_answer_on_a_host_device(device, tmp_path, capsys):
    """Megatron-LM's ``--record-memory-history`` calls, as its model provider and training loop
    make them: recording says in one line that the host keeps no history, and the snapshot it
    pickles is torch's format with nothing in it."""
    import pickle

    before = _snapshot()
    megatron_npu.apply(device, transfer=True)
    torch.cuda.memory._record_memory_history(
        True, trace_alloc_max_entries=100000, trace_alloc_record_context=True
    )
    torch.cuda.memory._record_memory_history(True)  # said once
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: None)
    assert torch.cuda.memory._snapshot() == {"segments": [], "device_traces": [[]]}
    torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    with open(tmp_path / "snapshot.pickle", "rb") as f:
        assert pickle.load(f) == {"segments": [], "device_traces": [[]]}
    megatron_npu.restore()
    said = [line for line in capsys.readouterr().out.splitlines() if "memory history" in line]
    assert said == [
        f"megatron-npu: the {device} device has no caching allocator, so memory history records "
        "nothing; its snapshots hold no segments and no trace events"
    ]
    # torch.cuda.memory's and torch._C's own names are back
    assert _changes(before) == [], "restore() left names rebound"


def test_default_mode_changes_nothing_process_wide():
    from megatron_npu import patcher

    before = _snapshot()
    megatron_npu.apply("cpu")
    changed = _changes(before)
    applied = {r.target for r in patcher.results() if r.status == patcher.APPLIED}
    megatron_npu.restore()
    # only the registry's own targeted patches touch these namespaces: Tensor.cuda / Tensor.type,
    # and on the CPU stand-ins the 16-bit products (matmul.*)
    assert set(changed) <= applied
    assert {"torch.Tensor.cuda", "torch.Tensor.type", "torch.matmul", "torch.bmm"} <= set(changed)
    assert _changes(before) == []


def test_transfer_switches_with_apply_arguments():
    megatron_npu.apply("cpu")
    assert not torch.cuda.is_available()
    megatron_npu.apply("cpu", transfer=True)  # same device, transfer asked: installed now
    assert torch.cuda.is_available()
    megatron_npu.apply("cpu")  # and removed again
    assert not torch.cuda.is_available() and not transfer.installed()


def test_process_group_backend_is_the_devices(monkeypatch):
    calls = []

    def init_process_group(
        backend=None,
        init_method=None,
        timeout=None,
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
        device_id=None,
    ):
        calls.append(("init", backend, world_size, rank))

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None):
        calls.append(("new", ranks, backend))

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.distributed, "new_group", new_group)
    megatron_npu.apply("cpu", transfer=True)
    torch.distributed.init_process_group(world_size=2, rank=1)
    torch.distributed.init_process_group("nccl")
    torch.distributed.init_process_group(backend="mpi")
    torch.distributed.new_group([0, 1])
    torch.distributed.new_group([0, 1], None, "nccl")
    megatron_npu.restore()
    assert torch.distributed.init_process_group is init_process_group
    assert calls == [
        ("init", "gloo", 2, 1),
        ("init", "gloo", -1, -1),
        ("init", "mpi", -1, -1),
        ("new", [0, 1], None),
        ("new", [0, 1], "gloo"),
    ]


def test_wrapped_torch_functions_keep_their_signature():
    megatron_npu.apply("cpu", transfer=True)
    try:
        assert "backend" in inspect.signature(torch.distributed.init_process_group).parameters
        assert torch.zeros.__name__ == "zeros"
    finally:
        megatron_npu.restore()


def test_cudagraphable_rng_tracker_runs_on_cpu():
    """Megatron's graph-safe tracker (use_cudagraphable_rng=True) forks a seeded stream on cpu
    exactly like a generator seeded the same way, and leaves the default stream untouched."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    megatron_npu.apply("cpu")
    try:
        tracker = CudaRNGStatesTracker(use_cudagraphable_rng=True)
        tracker.add("model-parallel-rng", 1234)
        torch.manual_seed(5)
        expected_default = torch.rand(3, generator=torch.Generator().manual_seed(5))
        reference = torch.Generator().manual_seed(1234)
        with tracker.fork("model-parallel-rng"):
            first = torch.rand(3)
        assert torch.equal(torch.rand(3), expected_default)
        with tracker.fork("model-parallel-rng"):
            second = torch.rand(3)
    finally:
        megatron_npu.restore()
    assert torch.equal(first, torch.rand(3, generator=reference))
    assert torch.equal(second, torch.rand(3, generator=reference))


@pytest.mark.skipif(
    torch.version.cuda is not None,
    reason="a CUDA build of torch (PyPI's for Python 3.12) has the graph-safe generator API, "
    "so Megatron's tracker builds without the adaptor: the premise holds on CPU builds only",
)
def test_cudagraphable_rng_tracker_fails_without_the_adaptor():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with pytest.raises(AssertionError, match="cudagraphs with RNG"):
        CudaRNGStatesTracker(use_cudagraphable_rng=True)


def test_graph_capture_is_refused_with_a_clear_message():
    megatron_npu.apply("cpu", transfer=True)
    try:
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(torch.Generator())
        with pytest.raises(RuntimeError, match="not available on a CPU device"):
            graph.capture_begin()
    finally:
        megatron_npu.restore()


def test_npu_defers_to_torch_npu_transfer_and_restore_undoes_it(tmp_path, monkeypatch):
    """On ``npu`` torch_npu's own transfer module does the mapping; every name it rebinds in the
    snapshotted namespaces is put back by uninstall (shown with a stand-in module)."""
    package = tmp_path / "torch_npu" / "contrib"
    package.mkdir(parents=True)
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "transfer_to_npu.py").write_text(
        textwrap.dedent(
            """
            import torch
            torch.cuda.is_available = lambda: "from torch_npu"
            torch.Tensor.is_npu_transferred = True
            torch.distributed.init_process_group = lambda *a, **k: "hccl"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torch_npu", "torch_npu.contrib", transfer.TORCH_NPU_TRANSFER):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = _snapshot()
    npu = Device(name="npu", torch_type="npu", dist_backend="hccl", accelerator=CpuAccelerator())
    assert transfer.install(npu) == "torch_npu"
    assert torch.cuda.is_available() == "from torch_npu" and torch.Tensor.is_npu_transferred
    # the allocator-history names torch_npu's transfer leaves are the device's
    assert torch.cuda.memory._snapshot == npu.accelerator.memory_history._snapshot
    assert (
        torch._C._cuda_attach_out_of_memory_observer
        == npu.accelerator.memory_history.attach_out_of_memory_observer
    )
    transfer.uninstall()
    assert _changes(before) == [] and not hasattr(torch.Tensor, "is_npu_transferred")
    assert transfer.TORCH_NPU_TRANSFER not in sys.modules
    for name in ("torch_npu", "torch_npu.contrib"):
        sys.modules.pop(name, None)


def test_auto_module_applies_transfer_for_the_environment_device(monkeypatch):
    monkeypatch.setenv("MEGATRON_NPU_DEVICE", "npu-emulated")
    monkeypatch.delitem(sys.modules, "megatron_npu.auto", raising=False)
    import megatron_npu.auto  # noqa: F401

    try:
        assert megatron_npu.active_device() == "npu-emulated" and transfer.installed()
    finally:
        megatron_npu.restore()
        sys.modules.pop("megatron_npu.auto", None)
    assert not transfer.installed()


def test_the_data_loader_is_adjusted_on_host_only_devices_alone(monkeypatch):
    """On cpu the loader gets a generator of its own and no pinned memory (there is no device
    to copy to); on a real npu without torch_npu's transfer module the mapping is the adaptor's,
    and the loader stays as torch ships it (pinned batches speed the copies to the NPU)."""
    monkeypatch.setattr(transfer, "has_torch_npu_transfer", lambda: False)
    npu = Device(name="npu", torch_type="npu", dist_backend="hccl", accelerator=CpuAccelerator())
    cpu = Device(name="cpu", torch_type="cpu", dist_backend="gloo", accelerator=CpuAccelerator())
    seen = {}
    for device in (cpu, npu):
        assert transfer.install(device) == "megatron-npu"
        try:
            loader = torch.utils.data.DataLoader(range(4), pin_memory=True)
            seen[device.name] = (loader.pin_memory, loader.generator is not None)
        finally:
            transfer.uninstall()
    assert seen == {"cpu": (False, True), "npu": (True, False)}
