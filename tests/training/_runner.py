"""Run ``python -m megatron_npu.train`` in a subprocess (real gloo ranks) and read its metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_npu.data.tokenizers import null_vocab_size_for
from megatron_npu.formats.metrics import MetricsFile, StepRecord

REPO = Path(__file__).resolve().parents[2]

#: Per launch; a run is ~10-30 s on two shared cores, the slack is for a loaded CI machine.
TIMEOUT_S = 240

#: The tiny fp32 model every layout test trains (dropout 0, same seed and data, the same initial
#: weights in every layout: --layout-independent-init); 256 token ids
#: (EOD included), so every TP size up to 2 pads the vocabulary to the same 256.
TINY = [
    "--device",
    "cpu",
    "--mock-data",
    "--vocab-size",
    str(null_vocab_size_for(256)),
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--seed",
    "1234",
    "--log-interval",
    "5",
    "--progress",
    "plain",
    "--layout-independent-init",
]


@dataclass
class Run:
    metrics: MetricsFile
    stdout: str
    metrics_path: Path

    @property
    def steps(self) -> list[StepRecord]:
        return self.metrics.steps

    @property
    def losses(self) -> dict[int, float]:
        return {s.step: s.lm_loss for s in self.steps}


def train(
    tmp: Path,
    *args: str,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    name: str = "run",
    torchrun: bool = False,
) -> Run:
    """Train with ``args`` on ``nproc`` ranks: through ``--nproc-per-node`` when > 1, or started
    by ``torchrun --standalone --nproc-per-node N -m megatron_npu.train`` with ``torchrun``."""
    tmp.mkdir(parents=True, exist_ok=True)
    metrics_path = tmp / f"{name}.metrics.json"
    module = ["-m", "megatron_npu.train", *args, "--metrics-out", str(metrics_path)]
    if torchrun:
        run_ = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        cmd = [sys.executable, *run_, *module]
    else:
        cmd = [sys.executable, *module]
        if nproc > 1:
            cmd += ["--nproc-per-node", str(nproc)]
    # MKL_DYNAMIC off: under load MKL may run a GEMM on fewer threads than asked, and on AVX-512
    # machines its kernels then sum in another order, which broke the bitwise comparisons
    # between two runs (host vs device initialisation) under xdist
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MKL_DYNAMIC": "FALSE", **(env or {})}
    full_env.pop("MEGATRON_NPU_DEVICE", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\nexit {proc.returncode}\n{output[-6000:]}"
    return Run(MetricsFile.read(metrics_path), output, metrics_path)


def max_abs_diff(a: dict[int, float], b: dict[int, float], steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)
