"""Starting the ranks, watching them, and joining them into Megatron's process groups.

Two ways in, one worker:

* ``megatron-npu train --nproc-per-node N ...`` (or ``python -m megatron_npu.train ...``) starts
  ``N`` local ranks itself (:func:`launch`), each a ``python -m megatron_npu.train`` process with
  torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``; rank = node rank x N + local rank, as torchrun's static
  rendezvous numbers them);
* ``torchrun -m megatron_npu.train ...`` starts the workers itself; each reads that environment.

Without either (no ``--nproc-per-node``, no ``RANK`` in the environment) the run is one rank.

:func:`launch` starts and stops the ranks with torch elastic's process layer, the one torchrun's
agent uses (``torch.distributed.elastic.multiprocessing.start_processes``): each rank in a session
(process group) of its own, a failure file per rank (``$TORCHELASTIC_ERROR_FILE``), the first
failure stopping the rest (SIGTERM to each rank's process group, SIGKILL after
:data:`STOP_GRACE_S`, then every rank's group), SIGINT/SIGTERM/SIGHUP/SIGQUIT to the launcher
stopping all ranks (exit 128 + the signal). What it adds where torch elastic falls short:

* a parent-death signal: torch elastic arms none, so a launcher killed with SIGKILL would leave
  its ranks running. Each rank arms ``PR_SET_PDEATHSIG`` (SIGKILL, Linux) before it does any
  work (:func:`arm_rank`), and exits if its launcher is already gone (its parent is no longer
  the launcher: a launcher killed during the rank's imports); each rank arms the same signal
  in every process it forks or spawns (:mod:`.children`: torch_dist's checkpoint writers, the
  checkpoint results ``Manager`` and the resource tracker), so they die with their rank;
* the rendezvous store bound before any rank starts: torchrun's static rendezvous lets rank 0
  bind ``MASTER_PORT`` after its imports, and a port chosen, released and bound again seconds
  later can be taken in between. The launcher on node 0 binds ``--master-port`` (or a port the
  kernel picks while binding; multi-node runs default to 29500) first, serves the store on that
  socket once the ranks are started (its server thread never exists across a fork), and every
  rank connects to it as a client, as to torch elastic's agent store. A port in use is one named
  error (preflight checks a given ``--master-port`` before that, too). The ranks key their
  rendezvous under the run's id, so a run never reads or overwrites another run's keys;
* the cause of a failure: the launcher watches the ranks itself, so the rank that failed first
  is the one named (torch elastic's ``wait`` stops the others first and counts them as failed);
* one named line instead of torchrun's failure summary: a rank's named error (:mod:`.errors`)
  goes to its error file, and the launcher prints each distinct one once (exit 2, or 3 for a
  stopped run), else which rank failed and how (exit 1); the error files live in a temporary
  folder that goes with the run (one whose launcher was killed with SIGKILL stays behind in
  ``$TMPDIR``, as ``megatron-npu-run-*``).

Tools that run many short jobs in one process (``locate``'s replays) start their ranks with
:func:`run_warm` instead: each rank is a function forked from a fork server that imported
Megatron once (:mod:`.warm_imports`), with the same torchrun environment and parent-death
signal, its output in a log, the first failure stopping the rest.
The process-group backend is the active device's (``gloo`` on cpu and npu-emulated, ``hccl`` on
npu, ``nccl`` on cuda).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from torch.distributed.elastic.multiprocessing.api import SignalException

from megatron_npu import console
from megatron_npu.devices.base import Device
from megatron_npu.files import write_private
from megatron_npu.training import children, errors, main_guard, preflight


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


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
    return DistEnv(0, 1, 0, master_addr, master_port or 0)  # 0: the rank's own store picks one


#: Seconds a rank gets to exit after SIGTERM before it is killed (launcher interrupted).
STOP_GRACE_S = 5.0
POLL_S = 0.05
#: Set by the launcher for its ranks: this run's id, the namespace of its rendezvous keys.
RUN_ID_ENV = "MEGATRON_NPU_RUN_ID"
#: torch elastic's own switch, set for the ranks as torchrun sets it: the launcher hosts the
#: store, so a rank that joins through ``env://`` (Megatron-LM's ``initialize_megatron``)
#: connects to it as a client instead of listening on the port itself.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def arm_rank() -> None:
    """Before a rank does any work: die with the launcher that started it
    (``PR_SET_PDEATHSIG``), and exit at once if that launcher is already gone. torch elastic
    starts each rank in a session of its own but arms no parent-death signal, so a launcher
    killed with SIGKILL would leave its ranks running; a rank that no launcher started does
    nothing here."""
    launcher = os.environ.get(errors.LAUNCHER_PID_ENV)
    if launcher and launcher.isdigit() and "RANK" in os.environ:
        children.die_with(int(launcher))


def _describe_exit(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with status {code}"


#: The port a multi-node run meets on when no ``--master-port`` is given (torchrun's default).
MULTI_NODE_PORT = 29500


def reserve_port(port: int, given: bool = True) -> socket.socket:
    """A socket listening on ``port`` on every address of this machine (0: a port the kernel
    picks as it binds), for :func:`host_store` to serve on. Binding it before any rank starts
    means no other program can take the port in between; a taken one is one named error."""
    dual = socket.has_dualstack_ipv6()
    try:
        return socket.create_server(
            ("", port),
            family=socket.AF_INET6 if dual else socket.AF_INET,
            dualstack_ipv6=dual,
            backlog=1024,
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise errors.port_in_use(port, given) from None
        raise


def host_store(
    master_addr: str,
    port: int,
    timeout: datetime.timedelta,
    listener: socket.socket | None = None,
) -> torch.distributed.TCPStore:
    """The run's rendezvous store, served from this process on ``port`` (0: a port the kernel
    picks as it binds; read it from ``.port``), or on the socket :func:`reserve_port` bound
    (the store takes it over). Ranks connect with ``is_master=False``."""
    if listener is not None:
        port = listener.getsockname()[1]
        return torch.distributed.TCPStore(
            master_addr,
            port,
            None,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
    try:
        return torch.distributed.TCPStore(
            master_addr, port, None, True, timeout, wait_for_workers=False
        )
    except Exception as exc:
        if _port_in_use(exc):
            raise errors.port_in_use(port) from None
        raise


def launch(argv: Sequence[str], args, module: str = "megatron_npu.train") -> int:
    """Start ``args.nproc_per_node`` local ranks running ``python -m <module>`` (default
    ``megatron_npu.train``; ``evaluate`` passes its worker) on ``argv`` and watch them (see the
    module docstring). Returns the run's exit status."""
    store = listener = context = None
    port = args.master_port
    if port is None:
        port = 0 if args.nnodes == 1 else MULTI_NODE_PORT
    if args.node_rank == 0:  # node 0's launcher serves the store every rank of the run joins
        try:
            listener = reserve_port(port, given=args.master_port is not None)
        except errors.TrainingInputError as exc:
            return errors.report(exc)
        port = listener.getsockname()[1]
    nproc = args.nproc_per_node
    world = nproc * args.nnodes
    env: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun's rule: several ranks on one host must not each spawn a thread per core.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    rendezvous = run_id(args, port)
    env.update(
        {
            "MASTER_ADDR": args.master_addr,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(args.node_rank),
            AGENT_STORE_ENV: "True",
            "TORCHELASTIC_RESTART_COUNT": "0",  # read beside the agent store by older torch
            "TORCHELASTIC_RUN_ID": rendezvous,
            RUN_ID_ENV: rendezvous,
            errors.LAUNCHER_PID_ENV: str(os.getpid()),
            preflight.DONE_ENV: "1",
        }
    )
    _quiet_elastic_logs()
    previous = {s: signal.getsignal(s) for s in _stop_signals()}
    stopped_by = None
    with tempfile.TemporaryDirectory(prefix="megatron-npu-run-") as error_dir:
        try:
            context = start_processes(
                name="megatron-npu",
                entrypoint=sys.executable,
                args={local: ("-m", module, *strip_launch_options(argv)) for local in range(nproc)},
                envs={
                    local: {
                        **env,
                        "RANK": str(args.node_rank * nproc + local),
                        "LOCAL_RANK": str(local),
                    }
                    for local in range(nproc)
                },
                # the ranks write to this process's stdout and stderr; the folder holds only
                # each rank's error file ($TORCHELASTIC_ERROR_FILE) and goes with the run
                logs_specs=DefaultLogsSpecs(log_dir=error_dir, redirects=Std.NONE, tee=Std.NONE),
            )
            if listener is not None:  # serving starts a thread: only once every rank is forked
                timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
                store, listener = host_store(args.master_addr, port, timeout, listener), None
            failed = _first_failures(context, args.node_rank * nproc)
        except SignalException as stop:
            stopped_by = stop.sigval
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if context is not None:
                # SIGTERM, then SIGKILL after the grace; then every rank's process group, the
                # ranks that had ended too: no process a rank started outlives the run
                context.close(death_sig=signal.SIGTERM, timeout=STOP_GRACE_S)
                for pid in context.pids().values():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
            if listener is not None:
                listener.close()
            del store  # the rendezvous ends with the run (its ranks passed their last barrier)
        if stopped_by is not None:
            console.say(
                f"megatron-npu train: {stopped_by.name} received: stopped all {nproc} ranks"
            )
            return 128 + stopped_by
        return _outcome(failed, args.node_rank * nproc, context.error_files)


def _stop_signals() -> list[signal.Signals]:
    """The signals torch elastic turns into a stop of the run (``$TORCHELASTIC_SIGNALS_TO_HANDLE``,
    its default SIGTERM, SIGINT, SIGHUP and SIGQUIT): the launcher restores their handlers."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    return [getattr(signal, n.strip()) for n in names.split(",") if hasattr(signal, n.strip())]


def _first_failures(context, first_rank: int) -> list[tuple[int, int]]:
    """Wait until every rank has exited 0 (``[]``) or one has failed: then the (rank, exit code)
    of those that have failed by now, before any is stopped. torch elastic's own ``wait`` stops
    the others first and counts them as failed too, which would hide the cause."""
    while True:
        codes = {local: h.proc.poll() for local, h in context.subprocess_handlers.items()}
        failed = [(first_rank + local, c) for local, c in codes.items() if c not in (None, 0)]
        if failed:
            return failed
        if all(code == 0 for code in codes.values()):
            return []
        time.sleep(POLL_S)


def _outcome(failed: list[tuple[int, int]], first_rank: int, error_files: Mapping[int, str]) -> int:
    """The run's exit status, and its failure said once: each distinct named error the ranks
    left in their error files, else how the rank that failed first ended (a rank killed by a
    signal first: the others failing after it are an echo; then the lowest rank)."""
    if not failed:
        return 0
    failed = sorted(failed, key=lambda item: (item[1] >= 0, item[0]))
    messages = errors.collect(
        {first_rank + local: path for local, path in error_files.items()},
        [rank for rank, _ in failed],
    )
    if messages:
        for line, ranks in messages.items():
            where = (
                "" if len(ranks) == len(error_files) else f" (rank {', '.join(map(str, ranks))})"
            )
            console.error(f"{line}{where}")
        stopped = any(line.startswith(errors.STOPPED_PREFIX) for line in messages)
        return errors.STOPPED_EXIT_STATUS if stopped else errors.EXIT_STATUS
    rank, code = failed[0]
    console.error(f"megatron-npu train: {_describe_exit(rank, code)}; stopped the other ranks")
    return 1


def _quiet_elastic_logs() -> None:
    """torch elastic logs each rank it stops and the first failure; the launcher says the
    failure itself, once. ``$LOGLEVEL`` (torch elastic's own switch) keeps its logs."""
    if "LOGLEVEL" in os.environ:
        return
    prefix = "torch.distributed.elastic.multiprocessing"
    for name in [prefix, *logging.root.manager.loggerDict]:
        if name.startswith(prefix):
            logging.getLogger(name).setLevel(logging.CRITICAL)


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


def run_id(args, port: int) -> str:
    """A run's rendezvous namespace: the same on every node of a multi-node run (which shares
    its ``--master-addr:--master-port``), different for any other run."""
    if args.nnodes > 1:
        return f"{args.master_addr}:{port}"
    return uuid.uuid4().hex


def _port_in_use(exc: BaseException) -> bool:
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def init_process_group(env: DistEnv, device: Device, timeout_minutes: int) -> None:
    """Join the default process group on the device's backend; pin this rank's device.

    A rank of this launcher (or of :func:`run_warm`) connects to the store its launcher holds
    and keys its rendezvous under its run's id (``$MEGATRON_NPU_RUN_ID``), so it can neither
    read nor overwrite another run's keys. A run of one rank without a launcher serves its own
    store (on ``--master-port``, else a port picked as it binds); under torchrun the ranks
    meet through torchrun's ``MASTER_ADDR``/``MASTER_PORT``."""
    if device.torch_type != "cpu":
        device.accelerator.set_device(env.local_rank)
    if torch.distributed.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    namespace = os.environ.get(RUN_ID_ENV)
    if "RANK" not in os.environ:  # one rank, no launcher: it serves its own store
        store = host_store(env.master_addr, env.master_port, timeout)
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(store.port))
    elif namespace:  # started by launch() or run_warm(): the launcher holds the store
        store = torch.distributed.PrefixStore(
            f"megatron-npu/{namespace}/",
            torch.distributed.TCPStore(
                env.master_addr, env.master_port, env.world_size, False, timeout
            ),
        )
    else:  # torchrun's workers
        torch.distributed.init_process_group(
            backend=device.dist_backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
        return
    torch.distributed.init_process_group(
        backend=device.dist_backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def init_model_parallel(args) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=getattr(
            args, "hierarchical_context_parallel_sizes", None
        ),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
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


#: What a rank imports before it can do anything (a few seconds each time): the warm fork
#: server imports it once, and every rank started through :func:`run_warm` is forked from it.
WARM_MODULES = ("megatron_npu.training.warm_imports",)
RANK_LOG_TAIL_LINES = 25


_warm_lock = threading.Lock()
_warm_env: dict[str, str] | None = None


def _warm_context(env: dict[str, str]) -> multiprocessing.context.BaseContext:
    """The fork-server context, its server started under ``env``: what a process does when it
    starts (``sitecustomize`` on ``PYTHONPATH``, variables read at import) is done under the
    environment the ranks are asked to run in. A call with another environment than the
    running server's stops it and starts a new one; the stdlib has no public way to stop its
    fork server, so ``_stop`` (what CPython's own tests call) is used."""
    global _warm_env
    server = multiprocessing.forkserver._forkserver
    with _warm_lock:
        if _warm_env != env:
            server._stop()
            server.set_forkserver_preload(list(WARM_MODULES))
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            server.ensure_running()  # a no-op while it runs
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _warm_env = dict(env)
    return multiprocessing.get_context("forkserver")


class RankFailure(RuntimeError):
    """A rank started by :func:`run_warm` failed; the message ends with its log's tail."""


def _warm_rank(
    target: Callable[[Any], None], payload: Any, env: dict[str, str], log_path: str
) -> None:
    """A rank's first steps after the fork: die with the fork server (which dies with the
    process that started it), take the rank's environment, write stdout and stderr to its log,
    use the thread count its environment asks for (the fork server imported torch before), and
    start its own processes as a freshly started one does. A fork server's child inherits the
    ``forkserver`` start method; Megatron-LM's data-loader workers would then start a second
    fork server, which imports the script as ``__main__`` anew (seconds per run) where a rank
    started by torchrun forks them."""
    children.die_with_parent()
    multiprocessing.set_start_method(None, force=True)  # the platform's default again
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    target(payload)


def run_warm(
    target: Callable[[Any], None],
    payload: Any,
    world: int = 1,
    *,
    timeout_s: float = 900.0,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Run ``target(payload)`` on ``world`` local ranks, each with torchrun's environment, and
    wait; the first rank to fail stops the others and raises :class:`RankFailure` with its log's
    tail. The ranks fork from a fork server that has imported :data:`WARM_MODULES` once, so a
    caller that runs many short jobs one after another (locate's replays) pays for the imports
    once. ``target`` is a module-level function (it travels by name); ``log`` receives every
    rank's output. As with any multiprocessing start method but ``fork``, the caller's main
    module must import without side effects (``if __name__ == "__main__":``); a call from its
    top level outside that guard raises :class:`~.main_guard.UnguardedMainError` before any
    rank starts."""
    main_guard.check()
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    base["PYTHONUNBUFFERED"] = "1"
    ctx = _warm_context(base)
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=timeout_s))
    run = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="megatron-npu-ranks-") as tmp:
        procs, logs = [], []
        for rank in range(world):
            rank_env = dict(base)  # torchrun's variables, one rank too (as torchrun sets them)
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
            )
            rank_env[RUN_ID_ENV] = run
            rank_env[AGENT_STORE_ENV] = "True"
            rank_env["TORCHELASTIC_RESTART_COUNT"] = "0"
            logs.append(Path(tmp) / f"rank{rank}.log")
            proc = ctx.Process(target=_warm_rank, args=(target, payload, rank_env, str(logs[-1])))
            proc.start()
            procs.append(proc)
        failed = None
        deadline = time.monotonic() + timeout_s
        try:
            while failed is None and any(p.exitcode is None for p in procs):
                for rank, proc in enumerate(procs):
                    proc.join(POLL_S)
                    if proc.exitcode not in (None, 0):
                        failed = (rank, _describe_exit(rank, proc.exitcode))
                        break
                if failed is None and time.monotonic() > deadline:
                    failed = (0, f"the ranks timed out after {timeout_s:.0f} s")
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                proc.join()
        texts = [
            p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in logs
        ]
    if log is not None:
        write_private(log, "\n".join(texts))
    if failed is not None:
        rank, reason = failed
        tail = "\n".join(texts[rank].splitlines()[-RANK_LOG_TAIL_LINES:])
        raise RankFailure(f"{reason}:\n{tail}")
