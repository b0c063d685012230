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


def jit_fusions_compiled(job):
    """Whether this rank, started and applied for the job, has compiled anything: whether
    ``torch.compile`` ran (it imports dynamo), as it does when Megatron's fusions load as shipped.
    (The patched names themselves look eager either way while the adaptor is applied.)"""
    import sys

    return {"compiled": "torch._dynamo" in sys.modules}
