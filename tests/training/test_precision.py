"""fp16 (dynamic loss scaling) and bf16 train through Float16Module + mixed-precision optimizers;
a forced fp16 overflow step is skipped, counted and reported, and leaves the parameters alone."""

from __future__ import annotations

import pytest
from planting import plant_env

from ._runner import TINY, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _falls(run) -> None:
    losses = [s.lm_loss for s in run.steps if not s.skipped]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.1, losses


def test_bf16_dp2_distributed_optimizer_trains_on_the_emulated_npu_path(train_tmp):
    """bf16 + distributed optimizer, on the NPU code path (torch_npu kernels emulated on CPU),
    with the model options of Ascend's Megatron-LM adaptation guide: RMSNorm, SwiGLU (through the
    fused bias-SwiGLU patch: Megatron's default --bias-swiglu-fusion; test_fusion_flags.py counts
    the kernel calls), RoPE, fused attention in BSH with a window."""
    run = train(
        train_tmp,
        *[a if a != "cpu" else "npu-emulated" for a in TINY],
        "--bf16",
        "--train-iters",
        "20",
        "--use-distributed-optimizer",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--use-flash-attn",
        "--shape-order",
        "BSH",
        "--pre-tokens",
        "16",
        "--next-tokens",
        "0",
        nproc=2,
        name="bf16",
    )
    config = run.metrics.config
    assert config.arguments["bf16"] is True
    assert config.device == "npu-emulated" and config.device_emulated is True
    assert "not an NPU result" in run.stdout
    assert len(run.steps) == 20 and not any(s.skipped for s in run.steps)
    _falls(run)


def test_fp16_trains_and_a_forced_overflow_is_skipped(train_tmp):
    run = train(
        train_tmp,
        *TINY,
        "--fp16",
        "--train-iters",
        "20",
        "--tensor-model-parallel-size",
        "2",
        "--initial-loss-scale",
        "4096",
        "--hysteresis",
        "1",
        "--log-params-norm",
        nproc=2,
        name="fp16",
        env=plant_env("overflow-at-step-3"),
    )
    steps = {s.step: s for s in run.steps}
    assert len(steps) == 20
    assert [n for n, s in steps.items() if s.skipped] == [3]
    assert run.metrics.summary.skipped_steps == 1
    bad = steps[3]
    assert bad.grad_norm is None  # no norm: the update was not applied
    # parameters unchanged by the skipped step, changed by the ones around it
    assert bad.params_norm == steps[2].params_norm
    assert steps[2].params_norm != steps[1].params_norm
    assert steps[4].params_norm != steps[3].params_norm
    # the scheduler did not advance, the dynamic scaler backed off (hysteresis 1)
    assert steps[4].lr == bad.lr and steps[3].lr < steps[2].lr
    assert bad.loss_scale == steps[2].loss_scale / 2
    assert "number of skipped iterations:   1 |" in run.stdout
    assert "gradient overflow" in run.stdout
    _falls(run)
