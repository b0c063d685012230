"""Real multi-rank process groups for parity cases, on the device's own backend.

The backend comes from the device object (:attr:`megatron_npu.devices.Device.dist_backend`):
gloo for ``cpu`` and ``npu-emulated``, hccl for ``npu``, nccl for ``cuda``; a pool serves the jobs
of every device with its backend.

A :class:`RankPool` starts ``world`` spawned processes that join one process group and then run
:class:`~megatron_npu.parity.harness.Job` s sent to them, each on Megatron's model-parallel groups
for the job's layout. Every job has a deadline: a rank that raises surfaces with its traceback, a
rank that hangs is named, and in both cases the whole pool is terminated at once, so no process
outlives the failing case. Healthy pools are reused across cases and closed when the session ends;
a pool left without a job for :data:`IDLE_RELEASE_S` leaves its process groups until the next one.
Each worker dies with the process that started the pool (Linux's parent-death signal,
:mod:`megatron_npu.training.children`), also when that one is killed with no chance to close it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

#: Seconds a job may take on the slowest rank before the pool is killed.
DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_NPU_PARITY_TIMEOUT", "240"))
#: Seconds the ranks get to start (import torch and Megatron, join the group): a loaded CI
#: machine needs far longer than a job's own deadline for that.
STARTUP_TIMEOUT_S = 180.0
#: How long the remaining ranks get to report after one rank failed.
_GRACE_S = 5.0
#: Seconds without a job after which a pool's ranks leave their process groups (an idle gloo
#: group still polls, a parity session's pools sit idle through every test after the parity
#: cases); the next job joins a new world. Parity cases come far closer together than this.
IDLE_RELEASE_S = 10.0
#: The message that tells every rank to leave its process groups.
RELEASE = "release"


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each rank's traceback."""


class RankTimeout(RankError):
    """One or more ranks did not answer in time."""


#: What each rank runs for a job, as "module:function" (tests swap in failing/hanging ones).
DEFAULT_RUNNER = "megatron_npu.parity.harness:run_examples"


def backend_for(device: str) -> str:
    """The process-group backend ``device`` uses (from its device object, never hard-coded)."""
    from megatron_npu import devices

    return devices.make(device).dist_backend


def _worker(
    rank: int,
    world: int,
    store: str,
    conn: Any,
    runner: str = DEFAULT_RUNNER,
    device: str = "cpu",
    parent_pid: int | None = None,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if parent_pid is not None:  # die with the process that started the pool, however it ends
        from megatron_npu.training.children import die_with

        die_with(parent_pid)
    try:
        import torch

        from megatron_npu import devices
        from megatron_npu.patches import jit_fusions

        torch.set_num_threads(1)
        jit_fusions.load_eagerly(device)
        dev = devices.make(device)
        if dev.torch_type != "cpu":  # hccl / nccl: one accelerator per rank
            dev.accelerator.set_device(rank)
        _join_world(dev.dist_backend, store, rank, world)
        import importlib

        from megatron.core import parallel_state

        import megatron_npu

        module_name, _, function = runner.partition(":")
        run_job = getattr(importlib.import_module(module_name), function)
    except BaseException:  # noqa: BLE001  (report anything, including import errors)
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    layout: tuple[int, int, int] | None = None
    joined, worlds = True, 0

    def leave() -> None:
        # Megatron's destroy_model_parallel only forgets its groups: each stays alive with its
        # transport (a gloo group polls in a thread of its own, an hccl or nccl group holds a
        # communicator). Leaving the world destroys every group.
        nonlocal joined, layout
        if layout is not None:
            parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        joined, layout = False, None

    left_badly: str | None = None  # a failed release, answered to the next job
    while True:
        job = conn.recv()
        if job is None:
            break
        if job == RELEASE:  # idle: hold no group until the next job
            try:
                if joined:
                    leave()
            except BaseException:  # noqa: BLE001
                left_badly = traceback.format_exc()
            continue
        if left_badly is not None:
            conn.send(("error", f"leaving the process groups of an idle pool:\n{left_badly}"))
            left_badly = None
            continue
        try:
            megatron_npu.apply(job.device)
            wanted = (job.parallel.tp, job.parallel.pp, job.parallel.cp)
            if layout != wanted:
                if joined and layout is not None:
                    leave()
                if not joined:
                    # every rank receives the same messages, so all leave and join together,
                    # each world on a store of its own
                    worlds += 1
                    _join_world(dev.dist_backend, f"{store}.{worlds}", rank, world)
                    joined = True
                cp = job.parallel.cp
                parallel_state.initialize_model_parallel(
                    job.parallel.tp,
                    job.parallel.pp,
                    context_parallel_size=cp,
                    # a2a+p2p's pair of groups: an all-to-all within 2 ranks, a ring over CP / 2
                    hierarchical_context_parallel_sizes=[2, cp // 2] if cp % 2 == 0 else None,
                )
                layout = wanted
            conn.send(("ok", run_job(job)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    if joined:
        torch.distributed.destroy_process_group()


def _join_world(backend: str, store: str, rank: int, world: int) -> None:
    import torch

    torch.distributed.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
    )


class RankPool:
    """``world`` worker processes in one process group on ``device``'s backend."""

    def __init__(
        self,
        world: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        runner: str = DEFAULT_RUNNER,
        device: str = "cpu",
        idle_release_s: float = IDLE_RELEASE_S,
    ) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self.device = device
        self.idle_release_s = idle_release_s
        # one sender at a time: a job's messages and answers, or the idle timer's release
        self._lock = threading.RLock()
        self._idle: threading.Timer | None = None
        self.backend = backend_for(device)
        self._dir = tempfile.mkdtemp(prefix="megatron-npu-ranks-")
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        store = os.path.join(self._dir, "store")
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world, store, child, runner, device, os.getpid()),
                daemon=True,
                name=f"parity-rank{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start-up", max(self.timeout_s, STARTUP_TIMEOUT_S))
        self._release_when_idle()

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()

    def _release_when_idle(self) -> None:
        """From now on, release the ranks' groups after :attr:`idle_release_s` without a job."""
        self._cancel_idle()
        self._idle = threading.Timer(self.idle_release_s, self._release)
        self._idle.daemon = True
        self._idle.start()

    def _release(self) -> None:
        with self._lock:
            if threading.current_thread() is not self._idle:  # cancelled while it waited
                return
            for conn in self._conns:  # none once closed
                try:
                    conn.send(RELEASE)
                except (BrokenPipeError, OSError):  # a rank died: the ranks are out of step
                    self._close(force=True)  # and the manager starts another pool
                    return

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _collect(self, what: str, timeout_s: float | None = None) -> list[Any]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        answers: dict[int, tuple[str, Any]] = {}
        limit = deadline
        while len(answers) < self.world:
            if limit == deadline and any(kind == "error" for kind, _ in answers.values()):
                limit = min(deadline, time.monotonic() + _GRACE_S)  # once, at the first error
            for rank, conn in enumerate(self._conns):
                if rank in answers:
                    continue
                if not self._procs[rank].is_alive() and not conn.poll():
                    code = self._procs[rank].exitcode
                    answers[rank] = ("error", f"rank {rank} died (exit code {code})")
                elif conn.poll(0.05):
                    try:
                        answers[rank] = conn.recv()
                    except EOFError:
                        answers[rank] = ("error", f"rank {rank} closed its pipe")
            if time.monotonic() > limit:
                break
        errors = {r: a[1] for r, a in answers.items() if a[0] == "error"}
        silent = [r for r in range(self.world) if r not in answers]
        if errors or silent:
            self.close(force=True)
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if silent:
                parts.append(f"ranks {silent} gave no answer within {timeout_s:.0f}s")
            kind = RankTimeout if silent and not errors else RankError
            raise kind(f"{what} failed on {self.world} ranks:\n" + "\n".join(parts))
        return [answers[r][1] for r in range(self.world)]

    def submit(self, job: Any) -> Any:
        """Run ``job`` on every rank; return rank 0's result."""
        if not self.alive:
            codes = [proc.exitcode for proc in self._procs]
            self.close(force=True)
            ended = f" (its ranks' exit codes: {codes})" if codes else ""
            raise RankError(f"the rank pool is closed{ended}")
        if job.parallel.world != self.world:
            raise ValueError(f"job needs {job.parallel.world} ranks, pool has {self.world}")
        if backend_for(job.device) != self.backend:
            raise ValueError(
                f"job on {job.device} needs the {backend_for(job.device)} backend, the pool "
                f"runs {self.backend} (started for {self.device})"
            )
        with self._lock:
            self._cancel_idle()
            for conn in self._conns:
                conn.send(job)
            what = f"parity job {job.patch_id} {job.dtype} {job.parallel.label()}"
            result = self._collect(what)[0]
            self._release_when_idle()
            return result

    def close(self, force: bool = False) -> None:
        with self._lock:
            self._cancel_idle()
            self._close(force)

    def _close(self, force: bool) -> None:
        if not force:
            for conn in self._conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)


class PoolManager:
    """One healthy pool per world size and backend (``cpu`` and ``npu-emulated`` share gloo's),
    replaced after a failure, all closed on :meth:`close`."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, str], RankPool] = {}

    def get(self, world: int, device: str = "cpu") -> RankPool:
        key = (world, backend_for(device))
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            pool = self._pools[key] = RankPool(world, device=device)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
