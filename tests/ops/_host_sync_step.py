"""Worker for tests/ops/test_host_sync.py: one profiled ``megatron-npu train`` step of a tiny GPT
in this process, printing (as JSON) the device-to-host syncs the adaptor's attention caused.

Usage: ``python _host_sync_step.py DEVICE:PRE:NEXT ...`` (one step per configuration, one JSON
line each). The adaptor's fused attention
(what the DotProductAttention patch calls) and, on npu-emulated, the torch_npu kernel it calls are
wrapped in ``record_function`` markers; a sync (``aten::_local_scalar_dense``, what ``.item()``,
``bool()`` and ``int()`` of a tensor run) counts against the adaptor when a marker of its attention
encloses it and no kernel marker does (a sync inside torch_npu's kernel is the kernel's business;
on an NPU it is one device op). Syncs in the backward of the adaptor's own autograd functions count
as well.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ADAPTOR, KERNEL, SYNC = "megatron_npu.attention", "torch_npu.kernel", "aten::_local_scalar_dense"
#: autograd nodes of the adaptor's attention functions (their backward runs outside the marker)
ADAPTOR_BACKWARD = ("BandAttention", "BatchedBandAttention")


def _marked(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def main(device_name: str, pre: int, nxt: int) -> dict:
    import megatron_npu
    from megatron_npu import devices
    from megatron_npu.ops.settings import set_fused_attention
    from megatron_npu.patches import attention as attention_patch
    from megatron_npu.training import arguments, data, launch, loop

    argv = [
        "--device",
        device_name,
        "--mock-data",
        "--vocab-size",
        "256",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "10",
        "--lr",
        "1e-4",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--use-flash-attn",
        "--log-interval",
        "1000",
        "--progress",
        "plain",
        "--make-vocab-size-divisible-by",
        "128",
    ]
    args = arguments.parse_args(argv)
    megatron_npu.apply(device_name)
    device = devices.require_active()
    set_fused_attention(use_flash_attn=True, shape_order="SBH", pre_tokens=pre, next_tokens=nxt)
    unmarked = attention_patch.fused_attention
    attention_patch.fused_attention = _marked(unmarked, ADAPTOR)
    kernels = device.kernels
    if kernels is not None:
        kernel = kernels.npu_fusion_attention
        kernels.npu_fusion_attention = _marked(kernel, KERNEL)
    env = launch.dist_env()
    launch.init_process_group(env, device, 10)
    trainer = loop.build_trainer(args, env, device)
    iterators = data.iterators(args, trainer.train_data, trainer.model, 0)
    for chunk in trainer.model:
        chunk.train()
    trainer.step(1, iterators)  # warm-up: first-use caches are filled outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(2, iterators)
    events = prof.events()
    attention_calls = sum(e.name == ADAPTOR for e in events)
    kernel_calls = sum(e.name == KERNEL for e in events)
    syncs, blamed = 0, []
    for event in events:
        if event.name != SYNC:
            continue
        syncs += 1
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if KERNEL in chain:
            continue
        if ADAPTOR in chain or any(n in c for c in chain for n in ADAPTOR_BACKWARD):
            blamed.append(" <- ".join(chain[:6]))
    launch.shutdown()
    megatron_npu.restore()
    attention_patch.fused_attention = unmarked
    if kernels is not None:
        kernels.npu_fusion_attention = kernel
    return {
        "config": f"{device_name}:{pre}:{nxt}",
        "attention_calls": attention_calls,
        "kernel_calls": kernel_calls,
        "syncs_in_step": syncs,
        "attention_syncs": blamed,
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    for config in sys.argv[1:]:
        name, pre, nxt = config.split(":")
        print(json.dumps(main(name, int(pre), int(nxt))), flush=True)
