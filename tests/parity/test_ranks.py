"""The rank pool: a failing rank surfaces with its traceback, a hanging rank is named, and in
both cases every worker process is gone before the call returns; a pool whose owner is killed
leaves no worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_npu.parity.case import Parallel
from megatron_npu.parity.harness import Job
from megatron_npu.parity.ranks import RankError, RankPool, RankTimeout

from tests.faults._harness import alive as processes_alive

JOB = Job("any", "cpu", "float32", Parallel(tp=2), ())
REPO = Path(__file__).resolve().parents[2]


def _workers(pool):
    return list(pool._procs)


def test_failing_rank_surfaces_with_its_traceback_and_no_process_survives():
    pool = RankPool(2, timeout_s=60, runner="megatron_npu.parity._selftest:fail_on_rank_1")
    procs = _workers(pool)
    with pytest.raises(RankError) as err:
        pool.submit(JOB)
    text = str(err.value)
    assert "--- rank 1 ---" in text and "deliberate failure on rank 1" in text
    assert "Traceback" in text
    assert not any(p.is_alive() for p in procs)
    assert not pool.alive


def test_hanging_rank_is_named_and_killed():
    pool = RankPool(2, timeout_s=8, runner="megatron_npu.parity._selftest:hang_on_rank_1")
    procs = _workers(pool)
    with pytest.raises(RankTimeout, match=r"ranks \[1\] gave no answer within 8s"):
        pool.submit(JOB)
    assert not any(p.is_alive() for p in procs)


OWNER = """
import sys
from megatron_npu.parity.case import Parallel
from megatron_npu.parity.harness import Job
from megatron_npu.parity.ranks import RankPool

pool = RankPool(2, timeout_s=3600, runner="megatron_npu.parity._selftest:hang_on_rank_1")
print(" ".join(str(p.pid) for p in pool._procs), flush=True)
pool.submit(Job("any", "cpu", "float32", Parallel(tp=2), ()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_workers_die_with_a_killed_owner():
    """The owner is SIGKILLed while rank 1 sleeps in its job and rank 0 waits for it: no
    ``finally`` runs, and both workers are gone within seconds, not after the job's hour."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2, pids
        time.sleep(1)  # the job is running: rank 1 asleep, rank 0 in its barrier
    finally:
        owner.kill()
        owner.wait()
    alive = processes_alive(pids, deadline_s=20)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their killed owner"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads read from /proc")
def test_a_pool_keeps_no_groups_of_the_layouts_it_left():
    """A pool serving cases of alternating layouts holds the process groups of the current one
    alone: each gloo group keeps a transport thread polling and two work threads, and Megatron's
    ``destroy_model_parallel`` left them alive (hundreds of threads in a pool that served a parity
    run)."""
    pool = RankPool(2, timeout_s=120, runner="megatron_npu.parity._selftest:transport_threads")
    layouts = (Parallel(tp=2), Parallel(pp=2)) * 4
    try:
        counts = [pool.submit(Job("any", "cpu", "float32", p, ()))["gloo"] for p in layouts]
    finally:
        pool.close()
    # one layout's groups' threads (about sixty here), give or take a group the first world
    # leaves behind and threads of destroyed groups still ending; kept groups would add about
    # sixty threads per layout
    assert max(counts) - min(counts) < min(counts) / 4, counts


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads read from /proc")
def test_an_idle_pool_leaves_its_groups_and_the_next_job_joins_again():
    """A pool without a job for its idle time holds no layout's groups (an idle gloo group still
    polls, and a test session's pools sit idle through every test after the parity cases); the
    next job joins a new world and runs on its layout as before."""
    from megatron_npu.parity._selftest import gloo_threads

    pool = RankPool(
        2,
        timeout_s=120,
        runner="megatron_npu.parity._selftest:transport_threads",
        idle_release_s=1.0,
    )
    try:
        serving = pool.submit(JOB)["gloo"]
        deadline = time.monotonic() + 30
        while True:
            idle = [gloo_threads(p.pid) for p in _workers(pool)]
            if max(idle) * 4 < serving or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        again = pool.submit(JOB)["gloo"]  # the layout it left: its groups are built again
    finally:
        pool.close()
    assert max(idle) * 4 < serving, (idle, serving)
    assert abs(again - serving) < serving / 4, (again, serving)  # one layout's groups again


def test_a_crashing_rank_pool_cell_is_an_error_record():
    from megatron_npu.parity.harness import evaluate

    from megatron_npu.registry import get_patch

    patch = get_patch("cross-entropy.vocab-parallel")
    job = Job(patch.id, "cpu", "float32", Parallel(tp=2), ())
    pool = RankPool(2, timeout_s=60, runner="megatron_npu.parity._selftest:fail_on_rank_1")
    record = evaluate(job, pool=pool)
    assert (record.verdict.status, record.verdict.rule) == ("error", "crash")
    assert "deliberate failure on rank 1" in record.verdict.reason
    assert record.tensors == {} and not pool.alive


def _npu_like(monkeypatch, calls):
    """``npu`` answers as an NPU would (hccl, tensors on 'npu'), without torch_npu."""
    import types

    from megatron_npu import devices
    from megatron_npu.devices.base import Device

    real_make = devices.make
    accelerator = types.SimpleNamespace(
        set_device=lambda index: calls.append(("set_device", index))
    )

    def make(name):
        if name == "npu":
            return Device("npu", "npu", "hccl", accelerator)
        return real_make(name)

    monkeypatch.setattr(devices, "make", make)


def test_a_rank_joins_the_process_group_on_its_devices_backend(monkeypatch):
    """The worker takes the backend (and its per-rank device) from the device object: hccl for
    npu, where a hard-coded gloo would leave the NPU's collectives unused."""
    import torch.distributed
    from megatron_npu.parity import ranks

    calls = []
    _npu_like(monkeypatch, calls)

    def init_process_group(backend, **kwargs):
        calls.append(("init", backend, kwargs["rank"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    sent = []
    conn = type("Conn", (), {"send": lambda self, msg: sent.append(msg)})()
    ranks._worker(1, 2, "/nonexistent/store", conn, device="npu")
    assert calls == [("set_device", 1), ("init", "hccl", 1)]
    assert sent[0][0] == "error" and "stop here" in sent[0][1]
    calls.clear()
    ranks._worker(0, 2, "/nonexistent/store", conn, device="npu-emulated")
    assert calls == [("init", "gloo", 0)]


def test_pools_are_kept_per_backend_and_a_job_for_another_backend_is_refused(monkeypatch):
    from megatron_npu.parity import ranks

    _npu_like(monkeypatch, [])
    started = []

    class FakePool:
        alive = True

        def __init__(self, world, *, device):
            started.append((world, device, ranks.backend_for(device)))

    monkeypatch.setattr(ranks, "RankPool", FakePool)
    manager = ranks.PoolManager()
    assert manager.get(2, "cpu") is manager.get(2, "npu-emulated")  # both gloo
    manager.get(2, "npu")
    assert started == [(2, "cpu", "gloo"), (2, "npu", "hccl")]
    monkeypatch.undo()
    _npu_like(monkeypatch, [])
    pool = object.__new__(RankPool)
    pool.world, pool.backend, pool.device = 2, "gloo", "cpu"
    monkeypatch.setattr(RankPool, "alive", property(lambda self: True))
    with pytest.raises(ValueError, match="job on npu needs the hccl backend, the pool runs gloo"):
        pool.submit(Job("any", "npu", "float32", Parallel(tp=2), ()))


def test_a_single_process_case_opens_its_world_on_the_active_devices_backend(monkeypatch):
    import torch.distributed as dist
    from megatron_npu.parity.cases._common import megatron_parallel

    from megatron_npu import devices
    from megatron_npu.devices.base import Device

    # whatever this worker process ran before: the case sees a process without a world
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    seen = []

    def init_process_group(backend, **kwargs):
        seen.append(backend)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(devices, "active", lambda: Device("npu", "npu", "hccl", object()))
    with pytest.raises(RuntimeError, match="stop here"), megatron_parallel():
        pass
    monkeypatch.setattr(devices, "active", lambda: None)
    with pytest.raises(RuntimeError, match="stop here"), megatron_parallel():
        pass
    assert seen == ["hccl", "gloo"]


_KEPT_WORLD = """
import megatron_npu
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_npu.parity.cases._common import megatron_parallel, one_rank_world_kept

megatron_npu.apply("cpu")


def clean():
    return not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()

assert clean()
with one_rank_world_kept():
    with megatron_parallel():
        world = dist.group.WORLD
    with megatron_parallel():
        assert dist.group.WORLD is world  # the same world, kept between calls
assert clean()
try:
    with one_rank_world_kept(), megatron_parallel():
        raise RuntimeError("stop here")
except RuntimeError as exc:
    assert str(exc) == "stop here"
assert clean()
with megatron_parallel():  # outside a kept block: set up and torn down per call
    pass
assert clean()
print("ok")
"""


def test_a_kept_one_rank_world_serves_every_call_and_is_gone_when_the_block_ends():
    """A host-device job's one-rank world (``one_rank_world_kept``): later calls reuse the world
    the first one set up, and it is torn down when the block ends, also by an exception; in a
    fresh process, so that no earlier test's world is in the way."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _KEPT_WORLD], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
