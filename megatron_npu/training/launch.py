"""Starting the ranks and joining them into Megatron's process groups.

Two ways in, one worker:

* ``megatron-npu train --nproc-per-node N ...`` (or ``python -m megatron_npu.train ...``) starts
  ``N`` local workers through :func:`torch.distributed.launcher.api.elastic_launch` with a static
  rendezvous and ``megatron_npu.train.main`` as the entry point, as ``torchrun --nproc-per-node N
  --nnodes .. --node-rank .. --master-addr .. --master-port ..`` would.
* ``torchrun -m megatron_npu.train ...`` starts the workers itself; each reads ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT`` from the environment.

Without either (no ``--nproc-per-node``, no ``RANK`` in the environment) the run is one rank.
The process-group backend is the active device's (``gloo`` on cpu and npu-emulated, ``hccl`` on
npu, ``nccl`` on cuda).
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_npu.devices.base import Device


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


def launch(argv: Sequence[str], args, entry=None) -> int:
    """Start ``args.nproc_per_node`` local workers running ``entry`` (default
    ``megatron_npu.train.main``) on ``argv`` through torch's elastic launcher (static rendezvous,
    no restarts). ``entry`` must be a module-level function (spawn pickles it). 0 on success."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = args.master_port
    if port is None:
        port = free_port(args.master_addr) if args.nnodes == 1 else 29500
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=f"megatron-npu-{uuid.uuid4().hex[:8]}" if args.nnodes == 1 else "megatron-npu",
        rdzv_backend="static",
        rdzv_endpoint=f"{args.master_addr}:{port}",
        rdzv_configs={"rank": args.node_rank, "timeout": 60 * args.distributed_timeout_minutes},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    from megatron_npu.train import main  # imported by name, so spawn can pickle it

    entry = entry or main

    if args.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun's rule: several ranks on one host must not each spawn a thread per core.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // args.nproc_per_node))
    worker_argv = strip_launch_options(argv)
    try:
        elastic_launch(config, entry)(worker_argv)
    except ChildFailedError as exc:
        failures = ", ".join(
            f"rank {rank}: exit code {f.exitcode}" for rank, f in sorted(exc.failures.items())
        )
        print(f"megatron-npu train: worker(s) failed ({failures})", flush=True)
        return 1
    return 0


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
