"""LAMBADA on a checkpoint written by a short run shaped like the README's main job (TP2 on two
ranks, embedded corpus): the accuracy and the target log-likelihood agree across a TP1 and a TP2
load of that checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MODEL = [
    "--layout-independent-init",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
]


def _cli(*argv, env):
    done = subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_accuracy_is_equal_across_tp1_and_tp2_loads(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_NPU_PEAK_TFLOPS": "1"}
    ckpt = tmp_path / "ckpt"
    _cli(
        "train",
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        *MODEL,
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        "12",
        "--lr",
        "3e-3",
        "--log-interval",
        "6",
        "--save",
        str(ckpt),
        "--no-save-optim",
        "--progress",
        "none",
        "--default-corpus-dir",
        str(tmp_path / "corpus"),
        env=env,
    )
    results = {}
    # TP2 pads the vocabulary to 128 x 2: a TP1 load pads to 256 to hold the same model.
    for name, layout in {
        "tp1": ["--make-vocab-size-divisible-by", "256"],
        "tp2": ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
    }.items():
        out = tmp_path / f"{name}.json"
        printed = _cli(
            "evaluate",
            "--task",
            "lambada",
            "--load",
            str(ckpt),
            *MODEL,
            *layout,
            "--results-out",
            str(out),
            env=env,
        )
        # the default data is the corpus cloze set, and says so (it is not LAMBADA)
        assert "validation results on the corpus cloze set (LAMBADA format" in printed
        results[name] = json.loads(out.read_text())
    tp1, tp2 = results["tp1"], results["tp2"]
    assert (
        tp1["layout"]["tensor_model_parallel_size"] == 1
        and tp2["layout"]["tensor_model_parallel_size"] == 2
    )
    assert tp1["n"] == tp2["n"] == 200 and tp1["iteration"] == tp2["iteration"] == 12
    assert tp1["set"] == tp2["set"] == "corpus-cloze"
    assert tp1["correct"] == tp2["correct"] and tp1["accuracy"] == tp2["accuracy"]
    assert tp1["target_nll"] == pytest.approx(tp2["target_nll"], rel=1e-6)
    assert (
        0 < tp1["target_nll"] < 6.3
    )  # trained: below the uniform 257-way guess (ln 257 = 5.55) + slack


def test_a_transformer_engine_spec_checkpoint_evaluates_and_a_mismatch_is_one_line(tmp_path):
    """The main job evaluates each run's final checkpoint: a TE-spec run's loads (its core
    attention's ``_extra_state`` is not in a distributed checkpoint, and TE lets a load miss it);
    the same checkpoint read as another model (half the hidden size), on two ranks, is one line
    naming the tensor that does not fit, exit 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_NPU_PEAK_TFLOPS": "1"}
    ckpt, corpus = tmp_path / "ckpt", str(tmp_path / "corpus")
    te = ["--transformer-impl", "transformer_engine"]
    _cli(
        "train", *MODEL, *te, "--micro-batch-size", "4", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3", "--save", str(ckpt), "--no-save-optim",
        "--progress", "none", "--default-corpus-dir", corpus, env=env,
    )  # fmt: skip
    evaluate = ["evaluate", "--task", "lambada", "--load", str(ckpt), *te]
    out = tmp_path / "te.json"
    _cli(*evaluate, *MODEL, "--results-out", str(out), "--default-corpus-dir", corpus, env=env)
    assert json.loads(out.read_text())["iteration"] == 2
    other = [v if v != "64" else "32" for v in MODEL]  # --hidden-size 32
    refused = subprocess.run(  # on two ranks: both refuse it, the launcher says it once
        [sys.executable, "-m", "megatron_npu.cli", *evaluate, *other, "--nproc-per-node", "2",
         "--default-corpus-dir", corpus],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert errors == [
        f"megatron-npu evaluate: error: checkpoint {ckpt}/iter_0000002 could not be loaded "
        "(CheckpointingException: Global shape mismatch for loaded (torch.Size([128, 64])) and "
        "expected ((128, 32)) tensor for key embedding.position_embeddings.weight); save a new "
        "checkpoint, or pass --load-optional to start from scratch"
    ], refused.stderr[-2000:]
