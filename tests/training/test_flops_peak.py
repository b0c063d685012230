"""Model FLOPs (Megatron-LM's formula) against a GEMM-by-GEMM count, and the peak probe's cache."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_npu.devices.facts import CPU, FACTS
from megatron_npu.training import flops, peak
from megatron_npu.training.flops import gpt_model_flops_per_iteration


def _gemm_count(*, L, h, ffn, heads, groups, kv, s, V, B, swiglu, causal):
    """Forward FLOPs listed GEMM by GEMM, times 3 for forward + backward."""
    tokens = B * s
    qkv = 2 * tokens * h * (heads * kv + 2 * groups * kv)
    proj = 2 * tokens * heads * kv * h
    share = 0.5 if causal else 1.0
    scores = 2 * B * heads * s * s * kv * share
    context = 2 * B * heads * s * s * kv * share
    mlp = 2 * tokens * h * ffn * (3 if swiglu else 2)
    logits = 2 * tokens * h * V
    return 3 * (L * (qkv + proj + scores + context + mlp) + logits)


@pytest.mark.parametrize(
    "swiglu,causal,groups,kv", [(False, True, 4, 32), (True, False, 2, 32), (False, True, 4, 16)]
)
def test_flops_match_gemm_count(swiglu, causal, groups, kv):
    shape = dict(
        L=3, h=128, ffn=352 if swiglu else 512, heads=4, groups=groups, kv=kv, s=64, V=384, B=6
    )
    expected = _gemm_count(**shape, swiglu=swiglu, causal=causal)
    got = gpt_model_flops_per_iteration(
        num_layers=3,
        hidden_size=128,
        ffn_hidden_size=shape["ffn"],
        num_attention_heads=4,
        num_query_groups=groups,
        seq_length=64,
        padded_vocab_size=384,
        global_batch_size=6,
        swiglu=swiglu,
        causal=causal,
        kv_channels=kv,
    )
    assert got == pytest.approx(expected, rel=1e-12)


def test_flops_refuses_nonpositive_sizes():
    with pytest.raises(ValueError, match="seq_length"):
        gpt_model_flops_per_iteration(
            num_layers=1,
            hidden_size=8,
            ffn_hidden_size=32,
            num_attention_heads=2,
            num_query_groups=2,
            seq_length=0,
            padded_vocab_size=16,
            global_batch_size=1,
            swiglu=False,
            causal=True,
        )


def test_peak_probe_is_cached_and_env_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(peak.ENV_VAR, raising=False)
    monkeypatch.setitem(FACTS, CPU, dataclasses.replace(FACTS[CPU], probe_sizes=(64,)))
    first = peak.measured_peak_flops("cpu", torch.float32)
    assert first.source == "measured" and first.tflops > 0
    stored = json.loads(peak.cache_path().read_text())
    assert len(stored) == 1
    again = peak.measured_peak_flops("cpu", torch.float32)
    assert again.source == "cached" and again.tflops == first.tflops
    monkeypatch.setenv(peak.ENV_VAR, "2.5")
    stated = peak.measured_peak_flops("cpu", torch.float32)
    assert stated.source == "user" and stated.tflops == 2.5
    monkeypatch.setenv(peak.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="MEGATRON_NPU_PEAK_TFLOPS"):
        peak.measured_peak_flops("cpu", torch.float32)


def test_measuring_the_peak_leaves_the_training_generator_alone(tmp_path, monkeypatch):
    """A run that measures the peak (nothing cached yet) draws the same weights and dropout
    masks as one that reads the cached figure: the probe's operands come from its own
    generator, not from torch's default one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(peak.ENV_VAR, raising=False)
    monkeypatch.setitem(FACTS, CPU, dataclasses.replace(FACTS[CPU], probe_sizes=(64,)))
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    assert peak.measured_peak_flops("cpu", torch.float32).source == "measured"
    assert torch.equal(torch.get_rng_state(), before)


def test_mfu_counts_devices_that_own_their_peak():
    p = peak.PeakFlops(1.0, "user", "npu", "bfloat16", "stated")
    assert peak.mfu(0.5e12, p) == pytest.approx(0.5)
    assert peak.mfu(0.5e12, p, devices=peak.aggregate_devices("npu", 4)) == pytest.approx(0.125)
    assert peak.aggregate_devices("npu-emulated", 4) == 1
    with pytest.raises(ValueError, match="--peak-tflops"):
        peak.resolve_peak("cpu", torch.float32, 0.0)


def test_metrics_summary_and_log_line_carry_flops_and_mfu():
    from megatron_npu.training import metrics

    run = metrics.RunMetrics(config={}, tokens_per_step=1024)
    run.model_flops_per_step = 2e9
    run.peak = peak.PeakFlops(0.5, "user", "npu", "bfloat16", "stated").as_dict()
    run.peak_devices = 2
    for step, seconds in enumerate([9.0, 9.0, 0.5, 0.4, 0.6], 1):
        run.add(
            metrics.StepRecord(
                step=step,
                lm_loss=3.0,
                grad_norm=1.0,
                lr=1e-3,
                loss_scale=1.0,
                skipped=False,
                step_time_s=seconds,
                tokens_per_s=1024 / seconds,
            )
        )
    summary = run.summary()
    assert summary["median_step_time_s"] == 0.5  # after the two warm-up steps
    assert summary["achieved_tflops_per_s"] == pytest.approx(2e9 / 0.5 / 1e12)
    assert summary["mfu"] == pytest.approx(2e9 / 0.5 / (0.5e12 * 2))
    interval = metrics.IntervalLog()
    for record in run.steps[2:]:
        interval.add(record)
    line = interval.line(5, 40, 8, run)
    assert "model TFLOP/s: 0.004 |" in line and "MFU: 0.40% |" in line
    no_peak = metrics.RunMetrics(config={}, tokens_per_step=1)
    assert no_peak.throughput(0.5) == (None, None)


def test_an_understated_peak_gives_no_mfu():
    from megatron_npu.training import metrics

    run = metrics.RunMetrics(config={}, tokens_per_step=1)
    run.model_flops_per_step = 1e9
    run.peak = peak.PeakFlops(1e-4, "measured", "cpu", "bfloat16", "probe").as_dict()
    run.add(
        metrics.StepRecord(
            step=1,
            lm_loss=3.0,
            grad_norm=1.0,
            lr=1e-3,
            loss_scale=1.0,
            skipped=False,
            step_time_s=1.0,
            tokens_per_s=1.0,
        )
    )
    summary = run.summary()
    assert summary["achieved_tflops_per_s"] == pytest.approx(1e-3)
    assert summary["mfu"] is None and summary["peak_understated"] is True
    assert peak.plausible(1.5) is None and peak.plausible(0.5) == 0.5


def test_moe_flops_count_only_the_active_experts():
    """A token passes through top-k experts (and the shared one): an MoE model with 8 experts
    of width 128, top-2 and a 64-wide shared expert costs what a dense model of FFN width
    2 * 128 + 64 costs; the number of experts does not enter (idle experts do no work)."""
    dense = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        seq_length=32,
        padded_vocab_size=256,
        global_batch_size=8,
        swiglu=True,
        causal=True,
    )
    active = flops.active_ffn_hidden_size(
        999,
        num_experts=8,
        moe_ffn_hidden_size=128,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=64,
    )
    assert active == 320
    assert (
        flops.active_ffn_hidden_size(
            999,
            num_experts=64,
            moe_ffn_hidden_size=128,
            moe_router_topk=2,
            moe_shared_expert_intermediate_size=64,
        )
        == active
    )
    assert flops.active_ffn_hidden_size(256) == 256  # a dense model
    moe = flops.gpt_model_flops_per_iteration(ffn_hidden_size=active, **dense)
    # the MLP GEMMs of one token: 3 of h x f per active expert width (SwiGLU), 2 FLOPs each,
    # forward + 2 backward -> 18 h f per token per layer
    mlp_delta = 18 * 64 * (active - 256) * 32 * 8 * 2
    assert moe - flops.gpt_model_flops_per_iteration(ffn_hidden_size=256, **dense) == mlp_delta


@pytest.mark.parametrize("q_rank", [None, 48])
def test_multi_latent_attention_flops_match_its_gemm_count(q_rank):
    """A multi-latent attention model's count (Megatron-LM's arguments by name, as train and an
    imported Megatron-LM log give them) against its GEMMs listed one by one, times 3, plus the
    two latent norms Megatron-LM counts as one more row of each down projection."""
    L, h, n, s, B, V, ffn = 2, 128, 4, 64, 6, 384, 512
    kv_rank, qk, pos, v = 32, 24, 8, 16
    tokens = B * s
    if q_rank is None:
        query = 2 * tokens * h * n * (qk + pos)
    else:
        query = 2 * tokens * h * q_rank + 2 * tokens * q_rank * n * (qk + pos)
    key_value = 2 * tokens * h * (kv_rank + pos) + 2 * tokens * kv_rank * n * (qk + v)
    output = 2 * tokens * n * v * h
    scores = 2 * B * n * s * s * (qk + pos) * 0.5  # causal: half the scores
    context = 2 * B * n * s * s * v * 0.5
    norms = 2 * tokens * ((q_rank or 0) + kv_rank)
    mlp = 2 * tokens * h * ffn * 2
    logits = 2 * tokens * h * V
    layer = query + key_value + output + scores + context + norms + mlp
    expected = 3 * (L * layer + logits)
    args = dict(
        num_layers=L,
        hidden_size=h,
        ffn_hidden_size=ffn,
        num_attention_heads=n,
        seq_length=s,
        global_batch_size=B,
        multi_latent_attention=True,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_head_dim=qk,
        qk_pos_emb_head_dim=pos,
        v_head_dim=v,
    )
    assert flops.model_flops_per_step(args, V) == pytest.approx(expected, rel=1e-12)
    standard = flops.model_flops_per_step({**args, "multi_latent_attention": False}, V)
    assert standard != pytest.approx(expected)  # the flag changes the count
