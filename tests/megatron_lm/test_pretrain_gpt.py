"""Megatron-LM's own ``pretrain_gpt.py`` (the tag matching the installed megatron-core, from the
steering repo's shared/ folder, unmodified) runs through the one-line wrapper on ``cpu`` and
``npu-emulated``: it trains, resumes bitwise, routes its fused paths to the NPU kernels, agrees
across TP layouts by the layout rule, and refuses what the adaptor cannot serve with one named
error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from once_per_run import built_once

from megatron_npu.compare import mlm_log, rules

from ._client import (
    MLA,
    PRECISION_AWARE,
    TINY,
    Run,
    check_trained,
    client_devices,
    client_specs,
    megatron_lm_folder,
    pretrain_gpt,
    read_run,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LLAMA = (
    "--position-embedding-type",
    "rope",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
)
#: Megatron-LM's default layer spec: Transformer Engine's classes (TINY asks for ``local``)
TE = ("--transformer-impl", "transformer_engine")
#: the NPU kernels a Llama-style bf16 step reaches through the adaptor
LLAMA_KERNELS = (
    "npu_fusion_attention",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_apply_adam_w",
)


def _curve(run: Run, iterations: range) -> rules.Curve:
    """Per-iteration TensorBoard scalars, at full precision (the log prints the loss to seven
    digits and the grad norm to three decimals)."""
    loss, norm = run.scalars("lm loss"), run.scalars("grad-norm")
    its = list(iterations)
    return rules.Curve(its, [loss.get(i) for i in its], [norm.get(i) for i in its], [])


@pytest.mark.parametrize("device", client_devices())
def test_pretrain_gpt_tp2_resume_is_bitwise(tmp_path, device):
    """TP2 with Megatron-LM's defaults (dropout 0.1, gradient-accumulation fusion, jit fusions):
    a resume from the iteration-6 checkpoint repeats iterations 7-12 of the straight run bitwise
    (loss and grad norm as TensorBoard recorded them)."""
    _resumes_bitwise(
        tmp_path,
        *TINY,
        "--mock-data",
        "--tensor-model-parallel-size",
        "2",
        name="tp2",
        device=device,
    )


def _kernel_counts(tmp_path, name: str) -> dict[str, int]:
    counts = json.loads((tmp_path / f"{name}.rank0.json").read_text())
    assert isinstance(counts, dict)
    return counts


def test_flash_attn_routes_to_the_npu_kernel(tmp_path):
    """``--use-flash-attn`` (bf16) on npu-emulated runs ``npu_fusion_attention`` in every layer
    of every micro-batch; without it Megatron's unfused attention runs and the kernel does not."""
    args = (*TINY, "--mock-data", "--train-iters", "20", "--bf16")
    runs = {}
    for name, extra in (("flash", ("--use-flash-attn",)), ("unfused", ())):
        env = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / name)}
        runs[name] = pretrain_gpt(
            tmp_path,
            *args,
            *extra,
            device="npu-emulated",
            name=name,
            env=env,
            tensorboard=False,
        )
        check_trained(runs[name], 20)
    flash, unfused = _kernel_counts(tmp_path, "flash"), _kernel_counts(tmp_path, "unfused")
    # 2 layers x 2 micro-batches x 20 iterations (the jit warm-up runs no attention)
    assert flash.get("npu_fusion_attention") == 80, flash
    assert unfused.get("npu_fusion_attention", 0) == 0, unfused
    assert flash.get("npu_gelu", 0) > 0 and flash.get("npu_apply_adam_w", 0) > 0, flash


#: a model two layouts and both layer specs train alike: vocab padded to 1280 in every layout,
#: weights initialised on the host (``--use-cpu-initialization``: Megatron draws each master
#: weight whole and slices it), no dropout
HOST_INITIALISED = (
    *TINY,
    "--mock-data",
    "--train-iters",
    "12",
    "--vocab-size",
    "1279",
    "--use-cpu-initialization",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
)


@pytest.fixture(scope="module")
def host_initialised_tp1(xdist_shared) -> Run:
    """:data:`HOST_INITIALISED` with the local spec at TP1 on cpu, run once for every test that
    compares against it."""

    def build(folder):
        folder.mkdir()
        pretrain_gpt(folder, *HOST_INITIALISED, name="tp1")

    return read_run(built_once(xdist_shared, "pretrain-gpt-host-initialised-tp1", build), "tp1")


def test_tp1_and_tp2_runs_agree_by_the_layout_rule(tmp_path, host_initialised_tp1):
    """The layout rule on Megatron-LM's own script: the same model
    (:data:`HOST_INITIALISED`): TP1 and TP2 losses agree per step within the layout rule's 1e-5
    (``megatron_npu.compare.rules.layout``)."""
    args = HOST_INITIALISED
    tp1 = host_initialised_tp1
    tp2 = pretrain_gpt(tmp_path, *args, "--tensor-model-parallel-size", "2", nproc=2, name="tp2")
    for run in (tp1, tp2):
        assert run.returncode == 0, run.tail()
        # the tokenizer's size before padding differs between releases (1280 with the EOD token
        # up to 0.17, 1279 from 0.18); the padded size is what makes the two models the same
        padded = {new for _, _, new in mlm_log.PADDED_VOCAB.findall(run.log)}
        assert padded == {"1280"}, padded
    verdict = rules.layout("tp2", "tp1", _curve(tp1, range(1, 13)), _curve(tp2, range(1, 13)))
    assert verdict.status == rules.PASS, verdict.detail


@pytest.mark.parametrize(
    "name, nproc, extra",
    [
        # + Megatron's straggler detector (timers, and NVML's readings reported as 0 here)
        pytest.param(
            "pp2",
            2,
            ("--pipeline-model-parallel-size", "2", "--log-straggler"),
            marks=pytest.mark.extended,
        ),
        pytest.param(
            "tp2-sp-distopt",
            2,
            (
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--use-distributed-optimizer",
            ),
            marks=pytest.mark.extended,
        ),
        # DP2 with Megatron-LM's overlap, recompute, evaluation and logging options
        (
            "dp2-options",
            2,
            (
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
                "--eval-iters",
                "2",
                "--eval-interval",
                "5",
                "--log-throughput",
                "--timing-log-level",
                "2",
                "--log-params-norm",
                "--log-num-zeros-in-grad",
                "--tensorboard-dir",
                "tb",
                "--log-memory-to-tensorboard",
                "--log-timers-to-tensorboard",
                "--log-validation-ppl-to-tensorboard",
            ),
        ),
        # the interleaved schedule: on gloo its sent outputs must outlive Megatron's early free
        # (patches/pipeline.py; NaN losses in about half the runs without it)
        (
            "vpp",
            2,
            (
                "--num-layers",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "8",
            ),
        ),
        # bf16 alone: the Llama-style run trains in bf16 too
        pytest.param("bf16", 1, ("--bf16",), marks=pytest.mark.extended),
        # a Llama-style model with Megatron-LM's default rope fusion (TE's fused RoPE here);
        # test_te_spec_runs reaches the same kernels with TP2 by default
        pytest.param(
            "llama-tp2",
            2,
            ("--tensor-model-parallel-size", "2", *LLAMA, "--bf16", "--use-flash-attn"),
            marks=pytest.mark.extended,
        ),
        ("fp16", 1, ("--fp16",)),
        # Megatron-LM's default spec (Transformer Engine's layers, served by the adaptor) under
        # PP2: the TE spec runs by default in the TE-spec tests, the pipeline in vpp
        pytest.param(
            "te-pp2", 2, (*TE, "--pipeline-model-parallel-size", "2"), marks=pytest.mark.extended
        ),
    ],
)
@pytest.mark.parametrize("device", client_devices())
@pytest.mark.parametrize("spec", client_specs())
def test_layouts_and_precisions_train(tmp_path, name, nproc, extra, device, spec):
    """The run list (npu-emulated and the local spec here; tox adds cpu and
    the Transformer Engine spec): 20 iterations, falling loss, exit 0; fp16 with Megatron's
    dynamic loss scaler (30 iterations)."""
    iterations = 30 if name == "fp16" else 20
    env = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / name)}
    run = pretrain_gpt(
        tmp_path,
        *TINY,
        "--mock-data",
        "--train-iters",
        str(iterations),
        "--transformer-impl",
        spec,
        *extra,
        nproc=nproc,
        device=device,
        name=name,
        tensorboard=False,
        env=env,
    )
    check_trained(run, iterations)
    if name.startswith("llama") and device == "npu-emulated":
        counts = _kernel_counts(tmp_path, name)
        assert all(counts.get(k, 0) > 0 for k in LLAMA_KERNELS), counts
    if "--log-straggler" in extra:
        assert "MnRtt/Rnk" in run.log, run.tail()
    if "--eval-interval" in extra:  # later --eval-* win over TINY's
        assert run.log.count("validation loss at iteration") >= 4, run.tail()


def _preprocess(jsonl, prefix) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_npu.cli",
            "preprocess",
            "--input",
            str(jsonl),
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "ByteLevel",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return f"{prefix}_text_document"


# preprocess's blended indexed data reaches Megatron's dataset builders by default in
# tests/training/test_data_sources.py
@pytest.mark.extended
@pytest.mark.parametrize("device", client_devices())
def test_real_indexed_data_from_megatron_npu_preprocess(tmp_path, device):
    """``megatron-npu preprocess`` output (byte-level ids, EOD 256) is real indexed data for
    Megatron-LM's ``--data-path`` with its NullTokenizer of the same vocab: the embedded corpus
    blended 0.7 / 0.3 with a second dataset (its first 40 documents)."""
    from megatron_npu.data.corpus import build_default_corpus

    build_default_corpus(tmp_path / "corpus")
    jsonl = next((tmp_path / "corpus").glob("*.jsonl"))
    head = tmp_path / "head.jsonl"
    head.write_text("".join(jsonl.read_text().splitlines(keepends=True)[:40]))
    whole = _preprocess(jsonl, tmp_path / "data" / "stdlib")
    part = _preprocess(head, tmp_path / "data" / "head")
    run = pretrain_gpt(
        tmp_path,
        *TINY,
        "--train-iters",
        "20",
        "--vocab-size",
        "257",
        "--data-path",
        "0.7",
        whole,
        "0.3",
        part,
        "--split",
        "100,0,0",
        device=device,
        name="indexed",
        tensorboard=False,
    )
    check_trained(run, 20)
    assert "BlendedDataset" in run.log, run.tail()


@pytest.mark.parametrize(
    "extra, options, header",
    [
        (
            ("--num-experts", "4", "--moe-token-dispatcher-type", "flex"),
            ("--moe-token-dispatcher-type flex",),
            "cannot run these Megatron-LM options",
        ),
        # three MoE mistakes at once: one line names them all (Megatron asserts on every rank)
        (
            ("--num-experts", "4", "--moe-router-topk", "6", "--expert-model-parallel-size", "3"),
            ("--moe-router-topk 6", "--num-experts 4", "does not divide the 2 ranks"),
            "these Megatron-LM options do not work together",
        ),
        # context parallelism with the local spec (Megatron asserts in DotProductAttention on
        # every rank) and a sequence that 2 x CP does not divide
        pytest.param(
            (
                "--context-parallel-size",
                "2",
                "--seq-length",
                "126",
                "--max-position-embeddings",
                "128",
            ),
            ("--transformer-impl local", "--seq-length 126"),
            "these Megatron-LM options do not work together",
            marks=pytest.mark.extended,
        ),
        # Megatron's recomputed MLP with biases recurses in the backward pass (it would run out
        # of memory here before the recursion limit)
        (
            ("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"),
            ("--recompute-modules mlp with linear biases",),
            "these Megatron-LM options do not work together",
        ),
        (
            ("--use-distributed-optimizer", "--use-precision-aware-optimizer", "--bf16")
            + ("--exp-avg-sq-dtype", "fp8"),
            ("--exp-avg-sq-dtype fp8",),
            "cannot run these Megatron-LM options",
        ),
    ],
    ids=[
        "moe-flex-dispatcher",
        "moe-topk-and-ep-sizes",
        "cp-local-spec-and-sequence",
        "recompute-mlp-with-biases",
        "precision-aware-fp8-moments",
    ],
)
def test_unsupported_option_is_one_named_error(tmp_path, extra, options, header):
    """An option the adaptor cannot serve, or options that cannot work together, stop every rank
    before anything is built, with one line naming the options, exit status 2, and no per-rank
    traceback."""
    run = pretrain_gpt(
        tmp_path,
        *TINY,
        "--mock-data",
        "--train-iters",
        "2",
        *extra,
        nproc=2,
        device="npu-emulated",
        name="refused",
        tensorboard=False,
    )
    assert run.returncode != 0
    lines = [line for line in run.log.splitlines() if line.startswith("megatron-npu: ")]
    assert len(lines) == 1, run.tail()
    assert header in lines[0] and all(option in lines[0] for option in options), lines[0]
    assert "exitcode  : 2" in run.log
    assert "[rank0]: Traceback" not in run.log and "[rank1]: Traceback" not in run.log


def test_context_parallel_trains_and_matches_cp1(tmp_path):
    """``--context-parallel-size 2`` through TE's attention (Megatron-LM's default spec) on a
    Llama-style model (RoPE, each chunk at its true positions; GQA; RMSNorm; SwiGLU): the ring
    (p2p) on cpu and Ulysses (a2a) with flash attention on npu-emulated, each against CP1 at the
    same global batch by the layout rule (host initialisation, no dropout: the same model);
    the a2a run's attention is ``npu_fusion_attention`` (one call per layer and micro-batch) and
    the ring's blocks on npu-emulated the ring kernels."""
    args = (
        *TINY,
        *TE,
        *LLAMA,
        "--mock-data",
        "--train-iters",
        "12",
        "--use-cpu-initialization",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
    )
    cp1 = pretrain_gpt(tmp_path, *args, name="cp1")
    check_trained(cp1, 12, min_applied=12)
    runs = {
        "p2p-cpu": ("cpu", ("--cp-comm-type", "p2p")),
        "a2a-flash": ("npu-emulated", ("--cp-comm-type", "a2a", "--use-flash-attn")),
    }
    for name, (device, extra) in runs.items():
        env = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / name)}
        run = pretrain_gpt(
            tmp_path,
            *args,
            "--context-parallel-size",
            "2",
            *extra,
            nproc=2,
            device=device,
            name=name,
            env=env,
        )
        check_trained(run, 12, min_applied=12)
        verdict = rules.layout(name, "cp1", _curve(cp1, range(1, 13)), _curve(run, range(1, 13)))
        assert verdict.status == rules.PASS, (name, verdict.detail)
    counts = _kernel_counts(tmp_path, "a2a-flash")
    # 2 layers x 2 micro-batches x 12 iterations, each rank all of its heads' sequence once
    assert counts.get("npu_fusion_attention") == 48, counts
    assert counts.get("npu_ring_attention_update", 0) == 0, counts


def test_multi_latent_attention_trains_as_megatrons_unfused_code(tmp_path):
    """Multi-latent attention with Megatron-LM's default spec and RoPE fusion (its default,
    Megatron's Triton kernels for CUDA: the adaptor's ``rotary.fused-mla-*`` serve it) and flash
    attention on npu-emulated (q/k heads 24 wide, v heads 8: ``npu_fusion_attention`` on the
    padded heads, one call per layer and micro-batch), alone and with the context-parallel ring,
    gives the curve of Megatron's own unfused code on cpu (``--no-rope-fusion``, its unfused
    attention): fp32, host-initialised weights, no dropout; the ring by the layout rule."""
    args = (
        *TINY,
        *TE,
        *MLA,
        "--mock-data",
        "--train-iters",
        "8",
        "--use-cpu-initialization",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
    )
    unfused = pretrain_gpt(tmp_path, *args, "--no-rope-fusion", name="unfused")
    check_trained(unfused, 8, min_applied=8)
    runs = {
        "fused": ((), 1, 2 * 2 * 8),
        "fused-cp2": (("--context-parallel-size", "2"), 2, None),
    }
    for name, (extra, nproc, attention_calls) in runs.items():
        env = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / name)}
        run = pretrain_gpt(
            tmp_path,
            *args,
            "--use-flash-attn",
            *extra,
            nproc=nproc,
            device="npu-emulated",
            name=name,
            env=env,
        )
        check_trained(run, 8, min_applied=8)
        if attention_calls is None:  # the ring: the layout rule against the one-rank curve
            verdict = rules.layout(
                name, "unfused", _curve(unfused, range(1, 9)), _curve(run, range(1, 9))
            )
            assert verdict.status == rules.PASS, (name, verdict.detail)
            assert _kernel_counts(tmp_path, name).get("npu_ring_attention_update", 0) > 0
            continue
        ours, megatron = _curve(run, range(1, 9)), _curve(unfused, range(1, 9))
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours.losses, megatron.losses, strict=True))
        print(f"multi-latent attention, fused against unfused: worst step {worst:.2e}")
        assert worst < 1e-5, (ours.losses, megatron.losses)
        assert _kernel_counts(tmp_path, name).get("npu_fusion_attention") == attention_calls


#: a Mixtral-style MoE block: 4 experts, top-2, SwiGLU experts without biases, aux loss
MOE = (
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--swiglu",
    "--disable-bias-linear",
    "--expert-model-parallel-size",
    "2",
)


@pytest.mark.parametrize(
    "name, device, extra",
    [
        # the local spec, alltoall dispatch over gloo, EP2; the first layer dense, the second MoE
        (
            "ep2-alltoall",
            "cpu",
            ("--moe-token-dispatcher-type", "alltoall", "--moe-layer-freq", "[0]+[1]"),
        ),
        # allgather dispatch with token dropping at capacity factor 1, and DeepSeek-V3-style
        # routing: sigmoid scores, expert bias, group-limited top-k, scaling, fp32 router, z-loss,
        # the fused router (npu_moe_gating_top_k) and the fused permutation (Megatron's unfused
        # code here: the allgather dispatcher permutes only the local experts' tokens)
        (
            "allgather-capacity",
            "npu-emulated",
            (
                "--moe-token-dispatcher-type",
                "allgather",
                "--moe-expert-capacity-factor",
                "1.0",
                "--moe-router-score-function",
                "sigmoid",
                "--moe-router-enable-expert-bias",
                "--moe-router-num-groups",
                "2",
                "--moe-router-group-topk",
                "1",
                "--moe-router-topk-scaling-factor",
                "2.5",
                "--moe-router-dtype",
                "fp32",
                "--moe-z-loss-coeff",
                "1e-3",
                "--moe-router-fusion",
                "--moe-permute-fusion",
            ),
        ),
        # megatron-core's legacy GroupedMLP (grouped_gemm.ops.gmm; up to 0.16), bf16 as it asks;
        # the fused permutation with experts padded to their capacity
        (
            "local-grouped-gemm",
            "npu-emulated",
            (
                "--moe-token-dispatcher-type",
                "alltoall",
                "--moe-grouped-gemm",
                "--bf16",
                "--moe-permute-fusion",
                "--moe-expert-capacity-factor",
                "1.0",
                "--moe-pad-expert-input-to-capacity",
            ),
        ),
        # the default TE spec: TP2 + SP with EP2 / ETP1, TE's grouped linears, the fused
        # permutation, a shared expert
        (
            "te-grouped-gemm",
            "npu-emulated",
            (
                *TE,
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "1",
                "--moe-token-dispatcher-type",
                "alltoall",
                "--moe-grouped-gemm",
                "--moe-permute-fusion",
                "--moe-shared-expert-intermediate-size",
                "128",
                "--bf16",
            ),
        ),
    ],
    ids=["ep2-alltoall", "allgather-capacity", "local-grouped-gemm", "te-grouped-gemm"],
)
def test_moe_trains(tmp_path, name, device, extra):
    """Mixture-of-experts layers through Megatron-LM's own ``pretrain_gpt.py``: 12 iterations,
    falling loss, the load-balancing loss logged every step, exit 0; with ``--moe-grouped-gemm`` on
    npu-emulated the experts' GEMMs reach ``npu_grouped_matmul`` (three calls per expert GEMM
    and micro-batch: forward, input gradient, weight gradient), never one GEMM per expert."""
    from packaging.version import Version

    from megatron_npu.patcher import megatron_core_version

    if Version(megatron_core_version()) < Version("0.14"):  # 0.13 has no fused router
        extra = tuple(e for e in extra if e != "--moe-router-fusion")
    iterations = 12
    env = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / name)}
    run = pretrain_gpt(
        tmp_path,
        *TINY,
        "--mock-data",
        "--train-iters",
        str(iterations),
        *MOE,
        *extra,
        nproc=2,
        device=device,
        name=name,
        env=env,
    )
    check_trained(run, iterations)
    # Megatron-LM writes the aux loss to TensorBoard on every release (to the console from 0.14)
    aux = run.scalars("load_balancing_loss")
    assert sorted(aux) == list(range(1, iterations + 1)), aux
    assert all(0.5 < value < 4.0 for value in aux.values()), aux  # near 1 for balanced routing
    grouped = "--moe-grouped-gemm" in extra
    if grouped and (TE[1] in extra or Version(megatron_core_version()) < Version("0.17")):
        counts = _kernel_counts(tmp_path, name)
        layers = 2  # TINY's --num-layers, every layer an MoE layer
        tp = 2 if "--tensor-model-parallel-size" in extra else 1
        micro_batches = 4 // (2 * (2 // tp))  # TINY's global batch / (micro batch x DP)
        expected = iterations * micro_batches * layers * 2 * 3  # FC1 and FC2, three calls each
        assert counts.get("npu_grouped_matmul") == expected, counts
    if "--moe-router-fusion" in extra:
        # the router's top-k through the gating kernel once per MoE layer and micro-batch, and
        # its backward kernel as often
        counts = _kernel_counts(tmp_path, name)
        calls = iterations * 1 * 2  # one micro-batch per step, 2 MoE layers
        assert counts.get("npu_moe_gating_top_k") == calls, counts
        assert counts.get("npu_moe_gating_top_k_backward") == calls, counts
    if "--moe-permute-fusion" in extra and "allgather" not in extra:
        # one permute and one unpermute kernel call per MoE layer and micro-batch, whatever the
        # number of experts (gradients go through the same calls)
        counts = _kernel_counts(tmp_path, name)
        tp = 2 if "--tensor-model-parallel-size" in extra else 1
        calls = iterations * (4 // (2 * (2 // tp))) * 2
        assert counts.get("npu_moe_token_permute_with_routing_map") == calls, counts
        assert counts.get("npu_moe_token_unpermute_with_routing_map") == calls, counts


def test_te_spec_runs(tmp_path):
    """Megatron-LM's default spec (``--transformer-impl transformer_engine``, served by the
    adaptor's TE stand-ins) trains a Llama-style model with TP2 + sequence parallelism, bf16,
    flash attention and query/key norms on npu-emulated; the step reaches the NPU kernels."""
    name = "te-llama-tp2-sp"
    env = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / name)}
    run = pretrain_gpt(
        tmp_path,
        *TINY,
        "--mock-data",
        "--train-iters",
        "20",
        *TE,
        *LLAMA,
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--bf16",
        "--use-flash-attn",
        "--qk-layernorm",
        "--attention-softmax-in-fp32",
        nproc=2,
        device="npu-emulated",
        name=name,
        tensorboard=False,
        env=env,
    )
    check_trained(run, 20)
    counts = _kernel_counts(tmp_path, name)
    assert all(counts.get(k, 0) > 0 for k in LLAMA_KERNELS), counts
    # the query/key norms and both fused input norms of 2 layers, per micro-batch (2) and step
    assert counts["npu_rms_norm"] >= 4 * 2 * 2 * 20, counts


def test_te_spec_equals_local_and_a_tp2_checkpoint_resumes_at_tp1(tmp_path, host_initialised_tp1):
    """fp32, host-initialised weights, no dropout: the TE spec's curve is the local spec's step
    for step (Megatron-LM draws the same weights; the norms are fused into QKV / FC1); a TE-spec
    checkpoint written at TP2 after 6 steps resumes at TP1, and steps 7-12 agree with the
    straight TP1 run by the layout rule (1e-5)."""
    args = HOST_INITIALISED
    te = pretrain_gpt(tmp_path, *args, *TE, name="te")
    local = host_initialised_tp1
    ckpt = str(tmp_path / "ckpt")
    saved = pretrain_gpt(
        tmp_path,
        *args,
        *TE,
        "--tensor-model-parallel-size",
        "2",
        "--save",
        ckpt,
        "--save-interval",
        "6",
        "--exit-interval",
        "6",
        nproc=2,
        name="tp2-saved",
    )
    # the RNG states are saved per TP rank; up to megatron-core 0.15 Megatron-LM cannot map them
    # onto another layout and stops (exit 0) unless told not to load them (no dropout here)
    resumed = pretrain_gpt(
        tmp_path, *args, *TE, "--load", ckpt, "--no-load-rng", name="tp1-resumed"
    )
    for run in (te, local, saved, resumed):
        assert run.returncode == 0, run.tail()
    assert saved.skipped and max(saved.skipped) == 6, saved.tail()
    assert resumed.skipped and min(resumed.skipped) == 7, resumed.tail()
    same = rules.layout("te", "local", _curve(local, range(1, 13)), _curve(te, range(1, 13)))
    assert same.status == rules.PASS, same.detail
    assert [te.losses[i] for i in range(1, 13)] == [local.losses[i] for i in range(1, 13)]
    verdict = rules.layout(
        "tp2-to-tp1", "te", _curve(te, range(7, 13)), _curve(resumed, range(7, 13))
    )
    assert verdict.status == rules.PASS, verdict.detail


def _resumes_bitwise(
    tmp_path, *args: str, name: str, env=None, device: str = "npu-emulated", timeout: int = 600
) -> Run:
    """12 iterations of ``args`` on two ranks of ``device``, saving at 6 and 12, and a resume
    from the iteration-6 checkpoint (as Megatron-LM's tracker file names it): iterations 7-12
    are bitwise those of the straight run. Returns the straight run. ``timeout``: seconds for
    each run."""
    ckpt = tmp_path / f"{name}-ckpt"
    common = (*args, "--train-iters", "12")
    straight = pretrain_gpt(
        tmp_path,
        *common,
        "--save",
        str(ckpt),
        "--save-interval",
        "6",
        nproc=2,
        device=device,
        name=f"{name}-straight",
        env=env,
        timeout=timeout,
    )
    check_trained(straight, 12)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")
    resumed = pretrain_gpt(
        tmp_path,
        *common,
        "--load",
        str(ckpt),
        nproc=2,
        device=device,
        name=f"{name}-resumed",
        env=env,
        timeout=timeout,
    )
    assert resumed.returncode == 0, resumed.tail()
    assert min(resumed.skipped) == 7 and max(resumed.skipped) == 12, resumed.tail()
    verdict = rules.deterministic(
        "resumed", "straight", _curve(straight, range(7, 13)), _curve(resumed, range(7, 13))
    )
    assert verdict.status == rules.PASS, verdict.detail
    return straight


# extended: bf16 (separate fp32 main parameters); in the default suite the fp32 case resumes
# through the same checkpoint wrapper, and the Megatron-FSDP test trains bf16 against it
@pytest.mark.parametrize(
    "precision",
    [pytest.param(("--bf16",), marks=pytest.mark.extended, id="bf16"), pytest.param((), id="fp32")],
)
def test_distributed_optimizer_resume_is_bitwise(tmp_path, precision):
    """``--use-distributed-optimizer`` (two data-parallel ranks) saves Megatron-LM's default
    ``dp_reshardable`` checkpoint and a resume from it repeats the straight run bitwise: the
    optimizer it loads into has no states yet, and each parameter gets its moments and its step
    back (in fp32 the main parameters are views of the model's own, which need grad)."""
    _resumes_bitwise(
        tmp_path, *TINY, "--mock-data", "--use-distributed-optimizer", *precision, name="distopt"
    )


def test_precision_aware_optimizer_trains_as_megatrons(tmp_path):
    """``--use-precision-aware-optimizer`` (TE's FusedAdam on a GPU) on npu-emulated: with fp32
    states on an fp32 model it is the distributed optimizer's own curve, bitwise."""
    common = (*TINY, "--mock-data", "--train-iters", "12", "--use-distributed-optimizer")
    device = "npu-emulated"
    plain = pretrain_gpt(tmp_path, *common, device=device, name="plain")
    aware = pretrain_gpt(
        tmp_path, *common, "--use-precision-aware-optimizer", device=device, name="aware"
    )
    check_trained(plain, 12)
    check_trained(aware, 12)
    verdict = rules.deterministic(
        "aware", "plain", _curve(plain, range(1, 13)), _curve(aware, range(1, 13))
    )
    assert verdict.status == rules.PASS, verdict.detail


# extended: in the default suite the recipe trains through pretrain_gpt.py
# (test_train_is_megatron_lm.py's bf16-precision-aware case), the distributed optimizer's
# checkpoint resumes bitwise (test_distributed_optimizer_resume_is_bitwise), and the recipe's
# states round-trip through an fp32 checkpoint (tests/test_precision_aware_optimizer.py)
@pytest.mark.extended
def test_precision_aware_recipe_resumes_bitwise(tmp_path):
    """The precision-aware optimizer's memory-saving recipe (bf16 model, bf16 grads and moments,
    the master as bf16 params + int16 remainders) on two data-parallel ranks of npu-emulated
    trains through ``npu_apply_adam_w`` and resumes bitwise from its checkpoint (TE's units:
    fp32 moments, int16 remainders)."""
    counts = {"MEGATRON_NPU_KERNEL_COUNTS": str(tmp_path / "recipe")}
    args = (*TINY, "--mock-data", *PRECISION_AWARE)
    _resumes_bitwise(tmp_path, *args, name="recipe", env=counts)
    assert _kernel_counts(tmp_path, "recipe").get("npu_apply_adam_w", 0) > 0


#: the precision-aware optimizer's bf16 recipe with Megatron's fp32 states, and half of it on
#: the host
_AWARE = ("--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer")
_HALF_OFFLOADED = ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5")


# extended: the split's branches and both halves' steps are tests/test_hybrid_offload.py's
# (default suite); this adds Megatron-LM's script, its checkpoint and the curve around them
@pytest.mark.extended
@pytest.mark.parametrize(
    "checkpoint_format",
    [(), ("--dist-ckpt-optim-fully-reshardable",)],
    ids=["megatron-lm-default", "fully-reshardable"],
)
def test_optimizer_cpu_offload_trains_as_the_precision_aware_optimizer(tmp_path, checkpoint_format):
    """``--optimizer-cpu-offload`` (with ``--use-precision-aware-optimizer``, as Megatron-LM
    requires), half the parameters offloaded, on two ranks of npu-emulated: it trains, resumes
    bitwise from its checkpoint, and follows the precision-aware optimizer's curve (fp32 master
    weights) within 1e-4 per step. Not bitwise: torch's AdamW steps the host half, the fused
    AdamW the rest, and their fp32 updates differ in the last bits before the bf16 rounding.
    It resumes from Megatron-LM's default format for the distributed optimizer and from
    ``fully_reshardable`` (the curve once): a format that keeps the optimizer's parameter groups
    in the common state (0.14's default, ``fully_reshardable``) holds both optimizers' classes
    there. The format is probed where Megatron-LM reads it: from 0.16 its options come from
    config classes, not from literal option strings."""
    checkpointing = megatron_lm_folder() / "megatron" / "training" / "checkpointing.py"
    if checkpoint_format and "args.dist_ckpt_optim_fully_reshardable" not in (
        checkpointing.read_text()
    ):
        pytest.skip(f"this Megatron-LM has no {checkpoint_format[0]} (its default is tested)")
    aware = (*TINY, "--mock-data", *_AWARE)
    offload = (*aware, *checkpoint_format, *_HALF_OFFLOADED)
    straight = _resumes_bitwise(tmp_path, *offload, name="offload")
    if checkpoint_format:
        return
    plain = pretrain_gpt(
        tmp_path, *aware, "--train-iters", "12", nproc=2, device="npu-emulated", name="aware"
    )
    check_trained(plain, 12)
    verdict = rules.layout(
        "offload", "aware", _curve(plain, range(1, 13)), _curve(straight, range(1, 13)), tol=1e-4
    )
    assert verdict.status == rules.PASS, verdict.detail


def test_legacy_checkpoint_of_an_offloaded_optimizer_resumes_bitwise(tmp_path):
    """``--optimizer-cpu-offload`` with Megatron-LM's legacy ``--ckpt-format torch`` on two
    ranks of npu-emulated resumes bitwise: the file holds the offloaded optimizer's classes in
    its parameter groups, which torch's ``weights_only`` load refuses unless they are allowed
    (Megatron-LM then prints the refusal and exits with status 0, having trained nothing). A
    checkpoint that cannot be loaded (no rng state, as ``--no-save-rng`` writes it, resumed
    without ``--no-load-rng``; a file that cannot be read) ends the run with one named line and
    status 2; the resumes take ``--use-checkpoint-args``, whose read of the file before training
    needs the same classes allowed."""
    import torch

    offload = (*TINY, "--mock-data", *_AWARE, *_HALF_OFFLOADED, "--ckpt-format", "torch")
    _resumes_bitwise(tmp_path, *offload, name="legacy")
    ckpt = tmp_path / "legacy-ckpt"
    state = ckpt / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt"
    without_rng = torch.load(state, weights_only=False)
    del without_rng["rng_state"]
    torch.save(without_rng, state)
    for fault, printed in (
        ("no-rng", "Unable to load rng state from checkpoint "),
        ("truncated", "could not load the checkpoint"),
    ):
        if fault == "truncated":
            state.write_bytes(state.read_bytes()[:1000])
        broken = pretrain_gpt(
            tmp_path,
            *offload,
            "--train-iters",
            "12",
            "--load",
            str(ckpt),
            "--use-checkpoint-args",
            nproc=2,
            device="npu-emulated",
            name=f"legacy-{fault}",
            tensorboard=False,
        )
        lines = [line for line in broken.log.splitlines() if line.startswith("megatron-npu: ")]
        assert len(lines) == 1, broken.tail()
        assert "Megatron-LM could not load the checkpoint: --load " in lines[0], lines
        # Megatron-LM's own line says why
        assert any(line.startswith(printed) for line in broken.log.splitlines()), broken.tail()
        assert "exitcode  : 2" in broken.log and not broken.losses, broken.tail()


@pytest.mark.parametrize("checkpoint_format", ["torch_dist", "torch"])
def test_a_checkpoint_before_the_first_fp16_update_resumes(tmp_path, checkpoint_format):
    """fp16 skips its first updates while the loss scale backs off (here from 2**20: iterations
    1 and 2), so the distributed optimizer's Adam has no state when the iteration-2 checkpoint
    is saved, and megatron-core saves it without moments: the resumed run cannot load it
    (``exp_avg`` ... not in state dict; the legacy save stops at ``KeyError: 'exp_avg'``). With
    the states given their first update's zeros, the
    resume from iteration 2 gives iterations 3-6 of the straight run bitwise."""
    common = (
        *TINY,
        "--mock-data",
        "--fp16",
        "--initial-loss-scale",
        str(2**20),
        "--use-distributed-optimizer",
        "--ckpt-format",
        checkpoint_format,
        "--train-iters",
        "6",
    )
    ckpt = tmp_path / "ckpt"
    straight = pretrain_gpt(
        tmp_path, *common, "--save", str(ckpt), "--save-interval", "2", name="straight"
    )
    assert straight.returncode == 0, straight.tail()
    # the iteration-2 save came before any applied update
    assert [i for i in sorted(straight.skipped) if straight.skipped[i]] == [1, 2], straight.tail()
    assert sorted(straight.losses) == [3, 4, 5, 6], straight.tail()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = pretrain_gpt(tmp_path, *common, "--load", str(ckpt), name="resumed")
    assert resumed.returncode == 0, resumed.tail()
    # it resumed at iteration 3 with the saved loss scale (2**20 again would skip iteration 3)
    assert sorted(resumed.skipped) == [3, 4, 5, 6], resumed.tail()
    assert not any(resumed.skipped.values()), resumed.tail()
    verdict = rules.deterministic(
        "resumed", "straight", _curve(straight, range(3, 7)), _curve(resumed, range(3, 7))
    )
    assert verdict.status == rules.PASS, verdict.detail


def test_torch_fsdp2_trains_as_data_parallel(tmp_path):
    """``--use-torch-fsdp2`` on two ranks of npu-emulated gives plain data parallelism's per-step
    losses and grad norms; where Megatron's own FSDP2 code fails (the installed releases'), one
    line names why, exit status 2, before anything is built."""
    import inspect
    from types import SimpleNamespace

    from megatron.core.distributed import TorchFullyShardedDataParallel

    from megatron_npu.patches import torch_fsdp2

    get_model_passes = (
        "disable_bucketing="
        in (megatron_lm_folder() / "megatron" / "training" / "training.py").read_text()
    )
    wrapper_takes = (
        "disable_bucketing" in inspect.signature(TorchFullyShardedDataParallel.__init__).parameters
    )
    megatron_fails = bool(torch_fsdp2.problems(SimpleNamespace(use_torch_fsdp2=True))) or (
        get_model_passes and not wrapper_takes
    )

    common = (
        *TINY,
        "--mock-data",
        "--train-iters",
        "4",
        "--untie-embeddings-and-output-weights",
        "--no-gradient-accumulation-fusion",
    )
    fsdp2 = pretrain_gpt(
        tmp_path,
        *common,
        "--use-torch-fsdp2",
        "--ckpt-format",
        "torch_dist",
        nproc=2,
        device="npu-emulated",
        name="fsdp2",
        tensorboard=False,
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"},  # Megatron's FSDP asserts more than one
    )
    lines = [line for line in fsdp2.log.splitlines() if line.startswith("megatron-npu: ")]
    if megatron_fails:
        assert len(lines) == 1 and "--use-torch-fsdp2: " in lines[0], fsdp2.tail()
        assert "exitcode  : 2" in fsdp2.log and "[rank0]: Traceback" not in fsdp2.log
        return
    assert fsdp2.returncode == 0, fsdp2.tail()
    assert any("NCCL communicator options for process group 'dp_cp'" in line for line in lines)
    ddp = pretrain_gpt(
        tmp_path, *common, nproc=2, device="npu-emulated", name="ddp", tensorboard=False
    )
    assert ddp.returncode == 0, ddp.tail()
    assert sorted(fsdp2.losses) == sorted(ddp.losses) == [1, 2, 3, 4]
    for step, loss in ddp.losses.items():
        assert abs(fsdp2.losses[step] - loss) <= 1e-6 * abs(loss), (fsdp2.losses, ddp.losses)
    assert fsdp2.grad_norms == ddp.grad_norms


def test_megatron_fsdp_trains_as_the_distributed_optimizer_and_resumes_bitwise(tmp_path):
    """``--use-megatron-fsdp`` fully sharded (``optim_grads_params``) on two ranks of
    npu-emulated, bf16 with Megatron-LM's defaults otherwise (gradient-accumulation fusion, whose
    weight gradient Megatron-FSDP writes into its fp32 buffer; the gradient reduce's div fusion,
    which asks NCCL for PREMUL_SUM): per step the distributed optimizer's losses and grad norms,
    and its ``fsdp_dtensor`` checkpoint resumes bitwise (each rank of this model holds empty
    shards of some parameters: without the adaptor's optimizer-state entry the save hangs).
    core_v0.13's forerunner, ``--use-custom-fsdp``, and megatron-core 0.14's Megatron-FSDP on
    torch 2.13 are refused in one line."""
    import importlib.util
    from types import SimpleNamespace

    from megatron_npu.patches import megatron_lm

    common = (*TINY, "--mock-data", "--use-distributed-optimizer", "--bf16")
    untied = ("--untie-embeddings-and-output-weights",)
    arguments = (megatron_lm_folder() / "megatron" / "training" / "arguments.py").read_text()
    # megatron-core 0.13 has no Megatron-FSDP (its Megatron-LM, --use-custom-fsdp)
    served = importlib.util.find_spec("megatron.core.distributed.fsdp") is not None
    fsdp = (
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--ckpt-format",
        "fsdp_dtensor",
    )
    if "'--megatron-fsdp-main-grads-dtype'" in arguments:  # from 0.17: the params' dtype (bf16)
        fsdp += ("--megatron-fsdp-main-grads-dtype", "fp32")  # the distributed optimizer's
    if not served or megatron_lm.refusals(SimpleNamespace(use_megatron_fsdp=True)):
        # core_v0.13's forerunner, and megatron-core 0.14's Megatron-FSDP on torch 2.13 (asked
        # for as Megatron-LM accepts it, its checkpoint format included)
        asked = fsdp if served else ("--use-custom-fsdp",)
        option = asked[0]
        refused = pretrain_gpt(
            tmp_path,
            *common,
            "--train-iters",
            "2",
            *asked,
            nproc=2,
            device="npu-emulated",
            name="refused-fsdp",
            tensorboard=False,
            env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"},  # Megatron-LM asserts more than one first
        )
        lines = [line for line in refused.log.splitlines() if line.startswith("megatron-npu: ")]
        assert len(lines) == 1 and f"{option}: " in lines[0], refused.tail()
        assert "exitcode  : 2" in refused.log and "[rank0]: Traceback" not in refused.log
        return
    straight = _resumes_bitwise(
        tmp_path,
        *common,
        *untied,
        *fsdp,
        name="fsdp",
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"},  # Megatron-FSDP asserts more than one
        timeout=240,  # ranks that part on a collective wait for each other without end
    )
    distopt = pretrain_gpt(
        tmp_path,
        *common,
        *untied,
        "--train-iters",
        "12",
        nproc=2,
        device="npu-emulated",
        name="distopt",
    )
    check_trained(distopt, 12)
    ours, theirs = _curve(straight, range(1, 13)), _curve(distopt, range(1, 13))
    assert ours.losses == theirs.losses
    # the norm sums squares over each rank's shards, which the two split differently
    for mine, reference in zip(ours.grad_norms, theirs.grad_norms, strict=True):
        assert abs(mine - reference) <= 1e-6 * reference, (ours.grad_norms, theirs.grad_norms)
    notice = "megatron-npu: with --use-megatron-fsdp, tied embeddings"
    assert notice not in straight.log  # untied
    tied_args = SimpleNamespace(use_megatron_fsdp=True, gradient_accumulation_fusion=True)
    refusal = megatron_lm.refusals(tied_args)  # megatron-core 0.15: Megatron-FSDP stops there
    tied = pretrain_gpt(
        tmp_path,
        *common,
        *fsdp,
        "--train-iters",
        "2",
        nproc=2,
        device="npu-emulated",
        name="fsdp-tied",
        tensorboard=False,
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"},
    )
    if refusal:
        lines = [line for line in tied.log.splitlines() if line.startswith("megatron-npu: ")]
        assert len(lines) == 1 and lines[0].endswith(refusal[0]), tied.tail()
        assert "exitcode  : 2" in tied.log and "[rank0]: Traceback" not in tied.log
        return
    assert tied.returncode == 0, tied.tail()
    assert tied.log.count(notice) == 1, tied.tail()  # rank 0 says it once


def test_te_cross_entropy_fusion_gives_the_unfused_loss(tmp_path):
    """``--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`` (Transformer Engine's
    vocab-parallel cross entropy, which Megatron cannot call without TE) at TP2 on npu-emulated:
    the per-step losses and grad norms of the unfused loss, to every printed digit. Where
    Megatron-LM's own argument check rejects the TE fusion (core_v0.18 on, on every device), the
    run ends with its message, as it does on a GPU."""
    common = (
        *TINY,
        "--mock-data",
        "--train-iters",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    )
    rejected = "Transformer Engine cross entropy loss fusion is disabled"
    arguments = megatron_lm_folder() / "megatron" / "training" / "arguments.py"
    runs = {
        name: pretrain_gpt(
            tmp_path, *common, *extra, nproc=2, device="npu-emulated", name=name, tensorboard=False
        )
        for name, extra in (
            ("unfused", ()),
            ("te", ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te")),
        )
    }
    assert runs["unfused"].returncode == 0, runs["unfused"].tail()
    if rejected in arguments.read_text():
        assert runs["te"].returncode != 0 and rejected in runs["te"].log, runs["te"].tail()
        return
    assert runs["te"].returncode == 0, runs["te"].tail()
    assert sorted(runs["te"].losses) == [1, 2, 3, 4]
    assert runs["te"].losses == runs["unfused"].losses
    assert runs["te"].grad_norms == runs["unfused"].grad_norms


def test_record_memory_history_writes_its_snapshots(tmp_path):
    """``--record-memory-history`` on npu-emulated: Megatron-LM's torch.cuda allocator-history
    calls are answered, the run says in one line that the host keeps no history, and the
    snapshot it pickles at each logged iteration is torch's format with no segments."""
    import pickle

    snapshot = tmp_path / "snapshot.pickle"
    run = pretrain_gpt(
        tmp_path,
        *TINY,
        "--mock-data",
        "--train-iters",
        "2",
        "--record-memory-history",
        "--memory-snapshot-path",
        str(snapshot),
        device="npu-emulated",
        tensorboard=False,
    )
    assert run.returncode == 0, run.tail()
    assert sorted(run.losses) == [1, 2]
    assert run.log.count("has no caching allocator, so memory history records nothing") == 1
    with open(snapshot, "rb") as f:
        assert pickle.load(f) == {"segments": [], "device_traces": [[]]}
