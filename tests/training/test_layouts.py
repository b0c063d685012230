"""Every TP/PP/DP layout computes the TP1 PP1 DP1 run: same first 10 losses within 1e-5.

fp32, dropout 0, same seed and data; each layout is a real multi-rank gloo run of
``python -m megatron_npu.train``. Equal losses need equal initial global weights in every layout
(megatron_npu.training.model seeds each layer by its global number) and the same global batch per
step (the pretraining sampler hands each DP rank its slice).
"""

from __future__ import annotations

import pytest
from tiers import with_extended

from ._runner import TINY, max_abs_diff, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOLERANCE = 1e-5
STEPS = range(1, 11)

LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # 8 samples / micro-batch 2 = 4 micro-batches through 2 stages
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2-interleaved": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    # Megatron's Transformer Engine spec (the adaptor's TE classes): the same model, its norms
    # fused into QKV / FC1, so the local baseline's losses
    "te-tp2-sp": (
        2,
        [
            "--transformer-impl",
            "transformer_engine",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
    "tp2-pp2-sp": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
}


def _report(name: str, diff: float, run) -> None:
    config = run.metrics.config
    print(
        f"\n{name}: world {config.world_size} (DP {config.data_parallel_size}), "
        f"max |loss - baseline| over steps 1-10 = {diff:.3e}"
    )


def test_baseline_learns(baseline):
    losses = baseline.losses
    assert sorted(losses) == list(STEPS)
    assert losses[10] < losses[1] - 0.2
    assert baseline.metrics.config.world_size == 1


def test_tp2_matches_baseline(baseline, tp2_saved):
    run, _ = tp2_saved
    assert run.metrics.config.world_size == 2
    diff = max_abs_diff(run.losses, baseline.losses, STEPS)
    _report("tp2", diff, run)
    assert diff <= TOLERANCE


def test_dp2_distributed_optimizer_under_torchrun_matches_baseline(baseline, dp2_saved):
    """DP2 + distributed optimizer + overlapped grad reduce and param gather, started by plain
    ``torchrun -m megatron_npu.train`` (RANK/WORLD_SIZE/... from the environment)."""
    run, _ = dp2_saved
    config = run.metrics.config
    assert config.world_size == 2 and config.data_parallel_size == 2
    diff = max_abs_diff(run.losses, baseline.losses, STEPS)
    _report("dp2-distopt-overlap (torchrun)", diff, run)
    assert diff <= TOLERANCE


def test_host_initialization_equals_device_initialization(baseline, train_tmp):
    """The baseline builds its weights on the device (the default); Megatron's host path
    (``--use-cpu-initialization``) gives the same model, so the same losses to the bit."""
    assert baseline.metrics.config.arguments["use_cpu_initialization"] is False
    run = train(train_tmp, *TINY, "--train-iters", "10", "--use-cpu-initialization", name="host")
    assert run.metrics.config.arguments["use_cpu_initialization"] is True
    # the first loss is the initial model's: to the bit. Later steps may differ by an ulp under
    # load (a clean-clone CI run saw step 2 off by 4.8e-7 with steps 3-10 bitwise equal: a
    # thread-dependent reduction order in MKL on AVX-512), so they are held to 1e-6 relative
    assert run.losses[1] == baseline.losses[1]
    assert run.losses.keys() == baseline.losses.keys()
    for step, loss in baseline.losses.items():
        assert abs(run.losses[step] - loss) <= 1e-6 * abs(loss), (step, run.losses, baseline.losses)


@pytest.mark.parametrize(
    "name",
    # PP2 with TP2 + SP, and the interleaved schedule: pretrain_gpt.py's run list has them too;
    # TP2 + SP with the local spec: te-tp2-sp runs the same layout by default
    with_extended(LAYOUTS, ("tp2-pp2-sp", "pp2-interleaved", "tp2-sp")),
)
def test_layout_matches_baseline(name, baseline, train_tmp):
    nproc, extra = LAYOUTS[name]
    run = train(train_tmp, *TINY, "--train-iters", "10", *extra, nproc=nproc, name=name)
    config = run.metrics.config
    assert config.world_size == nproc
    if name == "pp2":
        assert config.num_microbatches == 4
    diff = max_abs_diff(run.losses, baseline.losses, STEPS)
    _report(name, diff, run)
    assert diff <= TOLERANCE, (name, run.losses, baseline.losses)
