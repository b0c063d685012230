"""No device-to-host sync in the adaptor's attention hot path.

The end-to-end check profiles a real ``megatron-npu train`` step of a tiny GPT (in a subprocess:
it owns its process group) on cpu and npu-emulated, with full causal and windowed attention, and
counts the ``aten::_local_scalar_dense`` events (what ``.item()``/``bool()`` of a tensor run) that
the adaptor's attention caused (see ``_host_sync_step.py``): none are allowed. On an NPU each one
stalls the host until the device queue drains, per layer and micro-batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_npu.ops import attention as att
from megatron_npu.ops.attention import AttentionShape

CONFIGS = ("cpu:65536:65536", "npu-emulated:65536:65536", "cpu:16:0", "npu-emulated:16:0")


@pytest.fixture(scope="module")
def profiled_steps():
    worker = Path(__file__).with_name("_host_sync_step.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("MEGATRON_NPU_DEVICE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)  # one rank on a free port, the device each configuration names
    proc = subprocess.run(
        [sys.executable, str(worker), *CONFIGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["config"]: row for row in rows}


@pytest.mark.parametrize("config", CONFIGS)
def test_a_training_step_makes_no_host_sync_in_the_adaptors_attention(profiled_steps, config):
    row = profiled_steps[config]
    assert row["attention_calls"] == 4  # 2 layers x 2 micro-batches went through the adaptor
    if config.startswith("npu-emulated"):
        assert row["kernel_calls"] == 4  # ... and into npu_fusion_attention
    assert row["syncs_in_step"] > 0  # the profile does see syncs (Megatron's own, the loss)
    assert row["attention_syncs"] == []


def _shape(s=8):
    return AttentionShape(batch=2, heads=2, kv_heads=2, sq=s, skv=s, head_dim=4)


def _plain_causal(s=8):  # a fresh tensor each call, as a data loader hands out
    return torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s).expand(2, 1, s, s).clone()


def _syncs(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


def test_the_shared_causal_mask_is_recognised_without_a_comparison():
    mask = att.causal_mask(8, device="cpu")
    assert mask is att.causal_mask(8, 8, "cpu")
    assert torch.equal(mask[0, 0], _plain_causal()[0, 0])
    result, syncs = _syncs(lambda: att.without_redundant_causal_mask(mask, _shape(), True))
    assert result is None and syncs == 0


def test_another_mask_is_compared_once_per_tensor_and_again_after_an_in_place_change():
    mask = _plain_causal()
    first, syncs_first = _syncs(lambda: att.without_redundant_causal_mask(mask, _shape(), True))
    again, syncs_again = _syncs(lambda: att.without_redundant_causal_mask(mask, _shape(), True))
    assert (first, again) == (None, None)
    assert (syncs_first, syncs_again) == (1, 0)  # every later layer reuses the answer
    mask[..., 5, 2] = True  # now a document mask: the cached "causal" answer must not be used
    assert att.without_redundant_causal_mask(mask, _shape(), True) is mask
    other = _plain_causal()
    other[..., 6, 0] = True
    assert att.without_redundant_causal_mask(other, _shape(), True) is other


def test_a_fully_masked_row_still_outputs_zero_without_a_host_check():
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    mask = _plain_causal()
    mask[..., 3, :] = True  # query 3 sees nothing
    for path in ("native", "npu"):
        if path == "native":
            out = att.native_fused_attention(
                q, k, v, head_num=2, input_layout="BNSD", causal=True, attention_mask=mask
            )
        else:
            from megatron_npu.testing import torch_npu_emulation

            out = att.npu_fused_attention(
                torch_npu_emulation,
                q,
                k,
                v,
                head_num=2,
                input_layout="BNSD",
                causal=True,
                attention_mask=mask,
            )
        assert torch.all(out[:, :, 3] == 0), path
        assert torch.isfinite(out).all() and out[:, :, 4].abs().sum() > 0, path
