"""Job runners that misbehave on purpose, for testing :mod:`megatron_npu.parity.ranks` itself."""

from __future__ import annotations

import time

import torch


def fail_on_rank_1(job):
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    torch.distributed.barrier()  # rank 0 is left waiting for rank 1
    return {}


def hang_on_rank_1(job):
    if torch.distributed.get_rank() == 1:
        time.sleep(3600)
    return {"rank0": "answered"}


def megatron_fusions_compiled() -> tuple[bool, bool]:
    """(Megatron's ``bias_gelu`` is a torch.compile wrapper, ``megatron.core.jit.jit_fuser`` is
    ``torch.compile``) in this process, read with the adaptor restored: while it is applied the
    jit-eager entries make both look eager either way. (Whether ``torch._dynamo`` was imported
    says nothing: megatron-core 0.19 decorates an inference router with ``torch.compile`` at
    import, which imports dynamo and compiles nothing until it is called.)"""
    import torch
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_gelu

    import megatron_npu

    megatron_npu.restore()
    compiled = hasattr(fused_bias_gelu.bias_gelu, "_torchdynamo_orig_callable")
    return compiled, jit.jit_fuser is torch.compile


def jit_fusions_compiled(job):
    """Whether this rank, started and applied for the job, loaded Megatron's fusions compiled
    (:func:`megatron_fusions_compiled`); the adaptor is applied again afterwards, as the worker
    had it."""
    import megatron_npu

    try:
        compiled, fuser_is_compile = megatron_fusions_compiled()
    finally:
        megatron_npu.apply(job.device)
    return {"compiled": compiled or fuser_is_compile}


def gloo_threads(pid: int) -> int:
    """How many threads of process ``pid`` serve gloo process groups: each group's transport
    loop (``gloo_tcp_loop``) and work threads (``pt_gloo_runloop``)."""
    import os

    task = f"/proc/{pid}/task"
    count = 0
    for thread in os.listdir(task):
        try:
            with open(f"{task}/{thread}/comm") as comm:
                count += "gloo" in comm.read()
        except FileNotFoundError:  # ended while listed
            continue
    return count


def transport_threads(job):
    """How many threads of this rank serve gloo process groups (:func:`gloo_threads`)."""
    import os

    return {"gloo": gloo_threads(os.getpid())}
