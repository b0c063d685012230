"""Starting the ranks, watching them, and joining them into Megatron's process groups.

Two ways in, one worker:

* ``megatron-npu train --nproc-per-node N ...`` (or ``python -m megatron_npu.train ...``) starts
  ``N`` local ranks itself (:func:`launch`), each a ``python -m megatron_npu.train`` process with
  torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``; rank = node rank x N + local rank, as torchrun's static
  rendezvous numbers them);
* ``torchrun -m megatron_npu.train ...`` starts the workers itself; each reads that environment.

Without either (no ``--nproc-per-node``, no ``RANK`` in the environment) the run is one rank.
The process-group backend is the active device's (``gloo`` on cpu and npu-emulated, ``hccl`` on
npu, ``nccl`` on cuda).

What the launcher guarantees (issue 9's process faults):

* every rank runs in its own process group with a parent-death signal (``PR_SET_PDEATHSIG``,
  SIGKILL, Linux): a killed launcher takes its ranks with it; each rank sets the same signal on
  the processes it forks (torch_dist's checkpoint writers), so they die with their rank;
* the first rank to fail stops the run: the launcher kills every rank's process group at once
  (checkpoints are crash-safe, so nothing is lost) and says which rank failed and how -- the
  named error it left (:mod:`.errors`, exit 2) or its exit status / signal (exit 1);
* SIGINT or SIGTERM to the launcher stops all ranks (SIGTERM, then SIGKILL after
  :data:`STOP_GRACE_S`) and exits 130 / 143.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_npu.devices.base import Device
from megatron_npu.training import errors, preflight


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def dist_env(master_addr: str = "127.0.0.1", master_port: int | None = None) -> DistEnv:
    """This rank's place, from torchrun's environment (a single rank when it is absent)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", master_addr),
            master_port=int(env.get("MASTER_PORT", master_port or 29500)),
        )
    return DistEnv(0, 1, 0, master_addr, master_port or free_port(master_addr))


#: Seconds a rank gets to exit after SIGTERM before it is killed (launcher interrupted).
STOP_GRACE_S = 5.0
POLL_S = 0.05
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``); False where that does not exist."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


_fork_hook_installed = False


def children_die_with_this_process() -> None:
    """Every process forked from here on (torch_dist's checkpoint writers) gets SIGKILL when
    this process exits, so a killed rank leaves no writer behind."""
    global _fork_hook_installed
    if sys.platform.startswith("linux") and not _fork_hook_installed:
        os.register_at_fork(after_in_child=die_with_parent)
        _fork_hook_installed = True


def _rank_preexec(launcher_pid: int):
    def preexec() -> None:  # runs in the child between fork and exec
        os.setpgid(0, 0)
        die_with_parent()
        if os.getppid() != launcher_pid:  # the launcher died before the signal was armed
            os._exit(1)

    return preexec


def _kill_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _describe_exit(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with status {code}"


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def launch(argv: Sequence[str], args, module: str = "megatron_npu.train") -> int:
    """Start ``args.nproc_per_node`` local ranks running ``python -m <module>`` (default
    ``megatron_npu.train``; ``evaluate`` passes its worker) on ``argv`` and watch them (see the
    module docstring). Returns the run's exit status."""
    port = args.master_port
    if port is None:
        port = free_port(args.master_addr) if args.nnodes == 1 else 29500
    nproc = args.nproc_per_node
    world = nproc * args.nnodes
    env = dict(os.environ)
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        # torchrun's rule: several ranks on one host must not each spawn a thread per core.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    error_dir = tempfile.mkdtemp(prefix="megatron-npu-errors-")
    env.update({
        "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(args.node_rank),
        errors.ERROR_DIR_ENV: error_dir, preflight.DONE_ENV: "1",
    })  # fmt: skip
    command = [sys.executable, "-m", module, *strip_launch_options(argv)]
    procs: list[subprocess.Popen] = []
    preexec = _rank_preexec(os.getpid())

    def interrupted(signum, _frame):
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local in range(nproc):
            rank = args.node_rank * nproc + local
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local)}
            procs.append(subprocess.Popen(command, env=rank_env, preexec_fn=preexec))
        return _watch(procs, args.node_rank * nproc, error_dir)
    except _Interrupted as stop:
        _kill_groups(procs, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        _kill_groups(procs, signal.SIGKILL)
        name = signal.Signals(stop.signum).name
        print(f"megatron-npu train: {name} received: stopped all {len(procs)} ranks", flush=True)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _kill_groups(procs, signal.SIGKILL)  # no rank, no checkpoint writer outlives the run
        for proc in procs:
            proc.wait()
        shutil.rmtree(error_dir, ignore_errors=True)


def _watch(procs: list[subprocess.Popen], first_rank: int, error_dir: str) -> int:
    """Wait for the ranks; on the first failure kill the rest and report it once."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(first_rank + i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _kill_groups(procs, signal.SIGKILL)
            for proc in procs:
                proc.wait()
            break
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)
    failed.sort(key=lambda item: (item[1] >= 0, item[0]))  # a signal is the cause, not an echo
    messages = errors.collect(error_dir)
    if messages:
        for message, ranks in messages.items():
            where = "" if len(ranks) == len(procs) else f" (rank {', '.join(map(str, ranks))})"
            print(f"{errors.PREFIX}{message}{where}", file=sys.stderr, flush=True)
        return errors.EXIT_STATUS
    rank, code = failed[0]
    print(
        f"megatron-npu train: {_describe_exit(rank, code)}; stopped the other ranks",
        file=sys.stderr,
        flush=True,
    )
    return 1


_LAUNCH_VALUED = ("--nproc-per-node", "--nnodes", "--node-rank")


def strip_launch_options(argv: Sequence[str]) -> list[str]:
    """``argv`` without the options that only the launcher reads (workers see torchrun's env)."""
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in _LAUNCH_VALUED:
            skip = "=" not in item
            continue
        out.append(item)
    return out


def init_process_group(env: DistEnv, device: Device, timeout_minutes: int) -> None:
    """Join the default process group on the device's backend; pin this rank's device."""
    if device.torch_type != "cpu":
        device.accelerator.set_device(env.local_rank)
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    torch.distributed.init_process_group(
        backend=device.dist_backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}"
        if "RANK" not in os.environ
        else "env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


def init_model_parallel(args) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def shutdown(barrier: bool = True) -> None:
    """Leave Megatron's groups and the process group (after a barrier unless told otherwise)."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        try:
            if barrier:
                torch.distributed.barrier()
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
