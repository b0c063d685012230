"""The train command line: Megatron's names and rules, the fused-attention gate, launch options."""

from __future__ import annotations

import argparse
import re

import pytest

import megatron_npu
from megatron_npu.training import arguments, launch
from tests.megatron_lm._client import PRECISION_AWARE

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 3 --lr 1e-3 --mock-data"
).split()


def parse(*extra: str):
    return arguments.parse_args([*BASE, *extra])


def error_of(capsys, *extra: str) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(*extra)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_megatron_defaults_and_derived_sizes():
    args = parse()
    assert args.ffn_hidden_size == 256 and args.max_position_embeddings == 32
    assert args.num_query_groups == 4 and args.lr_decay_iters == 3
    assert (args.clip_grad, args.weight_decay, args.initial_loss_scale) == (1.0, 0.01, 2.0**32)
    assert args.vocab_size == 512 and args.seed == 1234
    arguments.finalize(args, world_size=4)
    assert args.data_parallel_size == 4 and args.global_batch_size == 8
    assert args.num_microbatches == 1


def test_swiglu_ffn_size_and_virtual_pipeline():
    args = parse(
        "--swiglu",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--global-batch-size",
        "8",
    )
    assert args.ffn_hidden_size == 128  # int(8 * 64 / 3 / 64) * 64
    assert args.virtual_pipeline_model_parallel_size == 2
    arguments.finalize(args, world_size=2)
    assert args.num_microbatches == 4


def test_sequence_parallel_is_dropped_without_tp():
    assert parse("--sequence-parallel").sequence_parallel is False
    assert parse("--sequence-parallel", "--tensor-model-parallel-size", "2").sequence_parallel


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fp16", "--bf16"], "not allowed with argument"),
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (["--tensor-model-parallel-size", "3"], "divisible by the TP size"),
        (["--data-path", "x"], "exclude each other"),
        (["--save-interval", "5"], "--save-interval needs --save"),
        # context parallelism: the named problems Megatron-LM's scripts get too
        (["--context-parallel-size", "2"], "context parallelism runs through TE's attention"),
        (
            ["--context-parallel-size", "3", "--transformer-impl", "transformer_engine"],
            "--seq-length 32: each of the 3 context-parallel ranks",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--transformer-impl",
                "transformer_engine",
                "--cp-comm-type",
                "a2a+p2p",
            ],
            "--cp-comm-type a2a+p2p",
        ),
        # a window narrower than the sequence: the ring serves none, the all-to-all does
        (
            [
                "--context-parallel-size",
                "2",
                "--transformer-impl",
                "transformer_engine",
                "--use-flash-attn",
                "--pre-tokens",
                "8",
            ],
            "--cp-comm-type p2p with --pre-tokens 8: the ring serves causal and full attention",
        ),
        # multi-latent attention: Megatron-LM's own rules, and the local spec has none
        (["--multi-latent-attention"], "--multi-latent-attention needs --transformer-impl"),
        (
            [
                "--multi-latent-attention",
                "--transformer-impl",
                "transformer_engine",
                "--group-query-attention",
            ],
            "--group-query-attention is mutually exclusive with --multi-latent-attention",
        ),
        (["--rope-type", "yarn"], "--rope-type yarn: attention other than multi-latent"),
        # activation recomputation: Megatron-LM's rules, and the MLP that recurses with biases
        (
            ["--recompute-activations", "--recompute-method", "uniform"],
            "--recompute-method uniform with --recompute-granularity selective",
        ),
        (["--recompute-granularity", "full"], "needs --recompute-method uniform|block"),
        (
            ["--recompute-granularity", "full", "--recompute-method", "block"],
            "needs --recompute-num-layers N",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
            "--recompute-modules mlp with linear biases",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            + ["--recompute-num-layers", "1", "--distribute-saved-activations"],
            "--distribute-saved-activations with --sequence-parallel",
        ),
        (
            ["--recompute-activations", "--recompute-num-layers", "1"],
            "--recompute-num-layers 1 with --recompute-granularity selective",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            + ["--recompute-num-layers", "1", "--distribute-saved-activations"],
            "--distribute-saved-activations: splits the saved inputs",
        ),
    ],
)
def test_inconsistent_options_fail(capsys, extra, message):
    assert message in error_of(capsys, *extra)


def test_a_window_under_context_parallelism_goes_to_the_all_to_all():
    cp = ("--context-parallel-size", "2", "--transformer-impl", "transformer_engine")
    assert parse(*cp, "--use-flash-attn", "--pre-tokens", "8", "--cp-comm-type", "a2a")
    # a window at least the sequence long narrows nothing: the ring serves it
    assert parse(*cp, "--use-flash-attn", "--pre-tokens", "31")


def test_batch_must_divide_into_micro_batches():
    args = parse("--global-batch-size", "6")
    with pytest.raises(arguments.ArgumentError, match="not divisible"):
        arguments.finalize(args, world_size=2)


def test_fused_attention_options_need_an_attention_patch(capsys, monkeypatch):
    monkeypatch.setattr(arguments, "fused_attention_patch_ids", lambda: [])
    err = error_of(capsys, "--pre-tokens", "2048")
    assert (
        "--pre-tokens 2048 needs the fused attention patch (attention.*), which this build "
        "does not have" in err
    )
    assert "need the fused attention patch" in error_of(
        capsys, "--use-flash-attn", "--shape-order", "BSH"
    )
    # values Megatron's own attention expresses need no patch
    args = parse("--shape-order", "SBH", "--pre-tokens", "65536", "--next-tokens", "65536")
    assert arguments.fused_attention_requests(args) == []


def test_fused_attention_gate_keys_off_the_registry(monkeypatch):
    monkeypatch.setattr(arguments, "fused_attention_patch_ids", lambda: ["attention.x"])
    args = parse(
        "--use-flash-attn", "--pre-tokens", "2048", "--next-tokens", "0", "--shape-order", "BSH"
    )
    assert arguments.fused_attention_requests(args) == [
        "--use-flash-attn",
        "--pre-tokens 2048",
        "--next-tokens 0",
        "--shape-order BSH",
    ]


def test_launcher_options_are_not_passed_to_workers():
    argv = ["--nproc-per-node", "2", "--nnodes=1", "--node-rank", "0", "--lr", "1", "--fp16"]
    assert launch.strip_launch_options(argv) == ["--lr", "1", "--fp16"]


def test_torchrun_environment_is_read(monkeypatch):
    for key, value in dict(
        RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"
    ).items():
        monkeypatch.setenv(key, value)
    assert launch.dist_env() == launch.DistEnv(3, 4, 1, "10.0.0.1", 1234)


def test_cli_train_reports_bad_options(capsys):
    from megatron_npu import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *BASE, "--fp16", "--bf16"])
    assert exc.value.code == 2
    assert "megatron-npu train" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option 1"),
        (["--fp16", "--bf16"], "argument --bf16: not allowed with argument --fp16"),
        # a rule of the checks after parsing
        (["--max-position-embeddings", "16"], "--max-position-embeddings must be >= --seq-length"),
    ],
)
def test_an_option_error_is_two_lines_not_the_usage(capsys, extra, error):
    """The usage in one line, then the error: not train's usage of some 130 lines."""
    from megatron_npu import cli

    with pytest.raises(SystemExit):
        cli.main(["train", *BASE, *extra])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "usage: megatron-npu train [options] (megatron-npu train --help lists them)"
    assert lines[1].startswith("megatron-npu train: error: ") and error in lines[1]


def test_launcher_checks_world_size_rules_before_starting_ranks(capsys):
    from megatron_npu import train

    rc = train.main([*BASE, "--global-batch-size", "6", "--nproc-per-node", "2", "--device", "cpu"])
    assert rc == 2
    assert "not divisible by micro batch size x data-parallel size = 4" in capsys.readouterr().err


def test_context_parallel_ranks_are_not_data_parallel_ranks():
    args = parse(
        "--context-parallel-size",
        "2",
        "--transformer-impl",
        "transformer_engine",
        "--tensor-model-parallel-size",
        "2",
        "--global-batch-size",
        "8",
    )
    arguments.finalize(args, world_size=8)
    assert args.data_parallel_size == 2 and args.num_microbatches == 2
    with pytest.raises(arguments.ArgumentError, match="not divisible by TP x PP x CP = 4"):
        arguments.finalize(args, world_size=6)


@pytest.mark.parametrize(
    "extra, fields",
    [
        (
            ["--recompute-granularity", "full", "--recompute-method", "block"]
            + ["--recompute-num-layers", "2"],
            {"recompute_granularity": "full", "recompute_method": "block"}
            | {"recompute_num_layers": 2},
        ),
        (
            ["--recompute-activations"],
            {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
        ),
        (
            ["--recompute-granularity", "selective", "--disable-bias-linear"]
            + ["--recompute-modules", "layernorm", "mlp"],
            {"recompute_granularity": "selective", "recompute_modules": ["layernorm", "mlp"]},
        ),
        ([], {"recompute_granularity": None}),
    ],
    ids=["full-block", "recompute-activations", "selective-modules", "none"],
)
def test_recompute_options_reach_megatrons_config(extra, fields):
    """Megatron-LM's recomputation options land in the TransformerConfig fields its
    ``core_transformer_config_from_args`` fills; TransformerBlock and TransformerLayer
    recompute by those."""
    from megatron_npu.training import model

    config = model.transformer_config(parse(*extra))
    assert {k: getattr(config, k) for k in fields} == fields


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype need --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer"], "needs --use-distributed-optimizer"),
        (
            ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]
            + ["--main-grads-dtype", "bf16"],
            "--main-grads-dtype bf16 needs --bf16",
        ),
        (["--exp-avg-sq-dtype", "fp8"], "--exp-avg-sq-dtype: invalid choice: 'fp8'"),
        (["--optimizer-cpu-offload"], "--optimizer-cpu-offload need --use-precision-aware"),
        (
            [*PRECISION_AWARE, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
            "--optimizer-offload-fraction 1.5 is out of range",
        ),
    ],
    ids=[
        "dtype-without-the-optimizer",
        "no-distributed-optimizer",
        "bf16-grads-fp32-model",
        "fp8",
        "offload-without-the-optimizer",
        "offload-fraction",
    ],
)
def test_precision_aware_options_are_checked_by_name(capsys, extra, message):
    assert message in error_of(capsys, *extra)


def test_precision_aware_options_reach_megatrons_optimizer_config():
    """As Megatron-LM's ``validate_args`` maps them: torch dtypes in the OptimizerConfig, and
    bf16 grads leave the gradient buffer in bf16 (no fp32 accumulation)."""
    import torch

    from megatron_npu.training import optimizer

    args = parse(*PRECISION_AWARE, "--exp-avg-sq-dtype", "fp16")
    assert not args.accumulate_allreduce_grads_in_fp32
    megatron_npu.apply("cpu")
    try:
        config = optimizer.optimizer_config(args)
    finally:
        megatron_npu.restore()
    assert config.use_precision_aware_optimizer
    assert (config.main_grads_dtype, config.main_params_dtype) == (torch.bfloat16, torch.float32)
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.bfloat16, torch.float16)
    assert parse("--bf16").accumulate_allreduce_grads_in_fp32


def test_cpu_offload_options_reach_megatrons_optimizer_config():
    """Megatron-LM's hybrid-optimizer options under their OptimizerConfig names, its defaults
    (all of the optimizer on the host, pinned copies, no overlap) when only the switch is given."""
    from megatron_npu.training import optimizer

    def config(*extra):
        megatron_npu.apply("cpu")
        try:
            return optimizer.optimizer_config(parse(*PRECISION_AWARE, *extra))
        finally:
            megatron_npu.restore()

    fields = ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads")
    plain = config("--optimizer-cpu-offload")
    assert plain.optimizer_cpu_offload
    assert tuple(getattr(plain, f) for f in fields) == (1.0, False, True)
    tuned = config(
        "--optimizer-cpu-offload",
        "--optimizer-offload-fraction",
        "0.25",
        "--overlap-cpu-optimizer-d2h-h2d",
        "--no-pin-cpu-grads",
        "--no-pin-cpu-params",
    )
    assert tuple(getattr(tuned, f) for f in fields) == (0.25, True, False)
    assert not tuned.pin_cpu_params and not config().optimizer_cpu_offload


def test_multi_latent_attention_options_reach_megatrons_config():
    """Megatron-LM's MLA option names land in the ``MLATransformerConfig`` fields its
    ``core_transformer_config_from_args`` fills (the rotary scaling factor from the option's
    default 1, not the dataclass's 40; YaRN unless --rope-type says otherwise), and the TE
    spec's attention is MLA's with the latents' norms under --qk-layernorm."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    import megatron_npu
    from megatron_npu.training import model

    mla = (
        "--transformer-impl",
        "transformer_engine",
        "--multi-latent-attention",
        "--q-lora-rank",
        "48",
        "--kv-lora-rank",
        "16",
        "--qk-head-dim",
        "24",
        "--qk-pos-emb-head-dim",
        "8",
        "--v-head-dim",
        "12",
        "--mscale-all-dim",
        "1.0",
        "--qk-layernorm",
    )
    config = model.transformer_config(parse(*mla))
    assert isinstance(config, MLATransformerConfig)
    got = {
        k: getattr(config, k)
        for k in (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "rotary_scaling_factor",
            "mscale",
            "mscale_all_dim",
            "rope_type",
            "qk_layernorm",
        )
    }
    assert got == {
        "q_lora_rank": 48,
        "kv_lora_rank": 16,
        "qk_head_dim": 24,
        "qk_pos_emb_head_dim": 8,
        "v_head_dim": 12,
        "rotary_scaling_factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_type": "yarn",
        "qk_layernorm": True,
    }
    assert model.transformer_config(parse(*mla, "--rope-type", "rope")).rope_type == "rope"
    megatron_npu.apply("cpu")  # the TE spec's classes are the adaptor's stand-ins
    try:
        spec = model.layer_spec(parse(*mla))
    finally:
        megatron_npu.restore()
    attention = spec.submodules.self_attention
    assert attention.module is MLASelfAttention
    norms = [
        getattr(attention.submodules, name).__name__
        for name in ("linear_q_up_proj", "linear_kv_up_proj")
    ]
    assert norms == ["TELayerNormColumnParallelLinear"] * 2, norms
    plain = model.transformer_config(parse("--transformer-impl", "transformer_engine"))
    assert type(plain) is not MLATransformerConfig


def test_moe_options_reach_megatrons_config():
    """Megatron-LM's MoE option names land in the TransformerConfig fields Megatron-LM's
    ``core_transformer_config_from_args`` fills; the expert FFN defaults to --ffn-hidden-size."""
    from megatron_npu.training import model

    args = parse(
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--swiglu",
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-num-groups",
        "4",
        "--moe-router-group-topk",
        "2",
        "--moe-router-dtype",
        "fp32",
        "--moe-z-loss-coeff",
        "1e-3",
        "--moe-shared-expert-intermediate-size",
        "64",
        "--expert-model-parallel-size",
        "2",
        "--disable-bias-linear",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-pad-expert-input-to-capacity",
        "--moe-token-drop-policy",
        "position",
        "--moe-permute-fusion",
        "--num-layers",
        "4",
        "--moe-layer-freq",
        "([1]+[0])*2",
    )
    arguments.finalize(args, world_size=2)
    megatron_npu.apply("cpu")  # TransformerConfig accepts --moe-permute-fusion with it only
    try:
        config = model.transformer_config(args)
    finally:
        megatron_npu.restore()
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (
        8,
        2,
        args.ffn_hidden_size,
    )
    assert config.moe_token_dispatcher_type == "alltoall"
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert config.moe_router_dtype == "fp32" and config.moe_z_loss_coeff == 1e-3
    assert config.moe_shared_expert_intermediate_size == 64
    assert config.expert_model_parallel_size == 2
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_drop_policy == "position" and config.moe_permute_fusion
    assert config.moe_layer_freq == [1, 0, 1, 0]
    assert model.transformer_config(parse()).num_moe_experts is None  # a dense model


@pytest.mark.parametrize(
    "freq, pattern", [("1", [1, 1, 1, 1]), ("2", [1, 0, 1, 0]), ("[0]+[1]*3", [0, 1, 1, 1])]
)
def test_moe_layer_freq_builds_dense_and_moe_layers_where_megatron_does(freq, pattern):
    """--moe-layer-freq N makes layers 0, N, 2N ... MoE layers (Megatron-LM's rule), a list
    expression names each layer; the model's layer specs follow it, the others are dense."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron_npu.parity.cases._common import megatron_parallel

    from megatron_npu.training import model

    args = parse(
        "--num-experts",
        "4",
        "--swiglu",
        "--disable-bias-linear",
        "--num-layers",
        "4",
        "--moe-layer-freq",
        freq,
    )
    arguments.finalize(args, world_size=1)
    megatron_npu.apply("cpu")
    try:
        with megatron_parallel():
            spec = model.block_spec(args, model.transformer_config(args), vp_stage=None)
    finally:
        megatron_npu.restore()
    layers = getattr(spec, "layer_specs", [spec] * 4)
    # the MLP's class: a ModuleSpec's module, or a builder's (megatron-core 0.18+)
    mlps = [s.submodules.mlp for s in layers]
    built = [int(getattr(m, "module", getattr(m, "func", None)) is MoELayer) for m in mlps]
    assert built == pattern


_SWIGLU = ("--swiglu", "--disable-bias-linear")


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--moe-layer-freq", "[1]*3", *_SWIGLU), "the pattern has 3 entries for --num-layers 2"),
        (("--moe-layer-freq", "[1,2]", *_SWIGLU), r"holds 0 \(dense\) and 1 \(MoE\) only"),
        (("--moe-layer-freq", "open('x')", *_SWIGLU), "not an integer or a list expression"),
        (("--moe-pad-expert-input-to-capacity", *_SWIGLU), "needs --moe-expert-capacity-factor"),
        ((), "--bias-gelu-fusion: megatron-core's experts"),
        (("--swiglu",), "--bias-swiglu-fusion: megatron-core's experts"),
    ],
    ids=[
        "pattern-length",
        "pattern-values",
        "not-a-pattern",
        "pad-without-capacity",
        "gelu-fusion",
        "biased-swiglu-fusion",
    ],
)
def test_moe_layer_and_capacity_options_are_checked_by_name(capsys, extra, message):
    """One line naming the option, exit 2 (a traceback per rank in Megatron otherwise)."""
    assert re.search(message, error_of(capsys, "--num-experts", "4", "--num-layers", "2", *extra))


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--num-experts", "4", "--moe-router-topk", "5"), "--moe-router-topk 5"),
        (("--num-experts", "6", "--expert-model-parallel-size", "4"), "does not divide"),
    ],
)
def test_broken_moe_options_are_one_named_error(extra, message, capsys):
    args = parse(*extra, "--swiglu", "--disable-bias-linear")
    with pytest.raises(arguments.ArgumentError, match=message.replace("-", r"\-")):
        arguments.finalize(args, world_size=4)
    # Megatron's flex dispatcher (DeepEP, CUDA-only) is not among the choices: argparse names it
    assert "invalid choice: 'flex'" in error_of(capsys, "--moe-token-dispatcher-type", "flex")


def test_offload_of_an_fp32_model_is_one_named_error(capsys):
    """The hybrid optimizer of an fp32 model fails in torch's constructor on every rank
    (tests/patches/test_megatron_lm_refusals.py); train names it before anything is built,
    with the line Megatron-LM's scripts get through the adaptor."""
    from megatron_npu.patches import megatron_lm

    offload = ("--use-distributed-optimizer", "--use-precision-aware-optimizer")
    offload += ("--optimizer-cpu-offload",)
    err = error_of(capsys, *offload)
    expected = megatron_lm.distributed_optimizer_problems(
        argparse.Namespace(use_distributed_optimizer=True, optimizer_cpu_offload=True)
    )
    assert expected and expected[0] in err
    assert parse(*offload, "--bf16").optimizer_cpu_offload


def test_sgd_with_the_distributed_optimizer_is_one_named_error(capsys):
    """megatron-core's DistributedOptimizer asserts Adam on every rank; train names it before
    anything is built, with the line Megatron-LM's scripts get through the adaptor."""
    from megatron_npu.patches import megatron_lm

    err = error_of(capsys, "--optimizer", "sgd", "--use-distributed-optimizer")
    assert "--optimizer sgd: Megatron's distributed optimizer takes Adam only" in err
    expected = megatron_lm.distributed_optimizer_problems(
        argparse.Namespace(optimizer="sgd", use_distributed_optimizer=True)
    )
    assert expected and expected[0] in err
    assert parse("--optimizer", "sgd").optimizer == "sgd"


def test_precision_aware_fp16_without_fp32_gradients_is_one_named_error(capsys):
    """megatron-core's gradient clipping asserts fp32 or bf16 gradients of the precision-aware
    optimizer (tests/patches/test_megatron_lm_refusals.py); train names it before anything is
    built, with the line Megatron-LM's scripts get through the adaptor."""
    from megatron_npu.patches import megatron_lm

    aware = ("--fp16", "--use-distributed-optimizer", "--use-precision-aware-optimizer")
    err = error_of(capsys, *aware)
    expected = megatron_lm.distributed_optimizer_problems(
        argparse.Namespace(
            use_precision_aware_optimizer=True,
            fp16=True,
            accumulate_allreduce_grads_in_fp32=False,
            clip_grad=1.0,
        )
    )
    assert expected and expected[0] in err
    assert parse(*aware, "--accumulate-allreduce-grads-in-fp32").use_precision_aware_optimizer
    assert parse(*aware, "--clip-grad", "0").use_precision_aware_optimizer
