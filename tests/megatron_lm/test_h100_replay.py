"""The standing proof: Megatron-LM core_v0.16.1's ``pretrain_gpt.py`` run natively on an H100
(``../shared/gpu-logs/h100-tiny``: a 4-layer GPT, CPU-initialised weights, dropout off, mock data,
60 steps) and the same command through ``megatron_npu.run_script`` on npu-emulated here give the
same curve: every one of the 60 steps' losses within 1e-5 relative in fp32 and within 1 % in bf16,
read off both runs' own logs by compare's Megatron-LM log importer. The bf16 run multiplies as the
GPU's tensor cores and the NPU's matrix unit do, accumulating in fp32 and rounding once (the
``matmul.*`` patches), at fp32's pace on a CPU without bf16 matrix instructions."""

from __future__ import annotations

import shlex

import pytest

from megatron_npu.compare import mlm_log
from megatron_npu.patcher import megatron_core_version

from ._client import REPO, pretrain_gpt

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

H100_TINY = REPO.parent / "shared" / "gpu-logs" / "h100-tiny"
#: the per-step bound of each precision (the README cites them)
BOUNDS = {"fp32": 1e-5, "bf16": 1e-2}


def _losses(path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in mlm_log.parse(path)["iterations"]}


@pytest.mark.skipif(
    not megatron_core_version().startswith("0.16."),
    reason="the H100 runs used megatron-core 0.16.1 (core_v0.16.1's pretrain_gpt.py)",
)
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.extended)])
def test_pretrain_gpt_on_npu_emulated_reproduces_the_h100_curve(tmp_path, precision):
    args = shlex.split((H100_TINY / "ARGS.txt").read_text())
    steps = 60
    if precision == "bf16":
        args += ["--bf16"]
    run = pretrain_gpt(
        tmp_path, *args, device="npu-emulated", name=precision, tensorboard=False, timeout=900
    )
    assert run.returncode == 0, run.tail()
    gpu = _losses(H100_TINY / f"gpt-{precision}.log")
    here = _losses(tmp_path / f"{precision}.log")
    assert sorted(here) == list(range(1, steps + 1)) and sorted(gpu) == list(range(1, 61))
    worst = max(abs(here[i] - gpu[i]) / abs(gpu[i]) for i in here)
    print(f"h100-tiny {precision}: worst per-step relative loss difference {worst:.2e}")
    assert worst <= BOUNDS[precision], worst
