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
