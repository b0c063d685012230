"""The ``train`` command line: Megatron-LM's option names, defaults and consistency rules.

Only what a GPT pretraining run on Megatron-Core needs is accepted; every option keeps the name
(and, where it has one, the default) it has in Megatron-LM's ``arguments.py``, so a
``pretrain_gpt_distributed*.sh`` command line carries over. The fused-attention options of Ascend's
Megatron-LM adaptation guide (``--use-flash-attn``, ``--shape-order``, ``--pre-tokens``,
``--next-tokens``) are validated here against the patch registry: a value that needs the fused
kernel fails unless a patch whose id starts with ``attention.`` is registered.

:func:`parse_args` parses and checks what can be checked without knowing the world size;
:func:`finalize` derives the data-parallel size, micro-batch count and virtual pipeline size once
the world size is known.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from megatron_npu.context_parallel_options import comm_types_of, context_parallel_problems
from megatron_npu.data.tokenizer_types import TOKENIZER_TYPES
from megatron_npu.devices import NAMES as DEVICE_NAMES
from megatron_npu.moe_options import moe_layer_pattern, moe_option_problems
from megatron_npu.ops.settings import FULL_WINDOW, FusedAttentionSettings
from megatron_npu.optimizer_options import (
    offload_problems,
    precision_aware_fp16_problems,
    sharded_optimizer_problems,
)
from megatron_npu.recompute_options import MODULES as RECOMPUTE_MODULES
from megatron_npu.recompute_options import recompute_problems_of
from megatron_npu.training.errors import TrainingInputError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


#: Megatron-LM's ``--seed`` default
DEFAULT_SEED = 1234


class ArgumentError(TrainingInputError, ValueError):
    """An inconsistent or unsupported combination of options."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _finite(text: str) -> float:
    """A float option: NaN and infinities are refused here, naming the flag (argparse adds it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if math.isnan(value) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


#: ``dest: (low, high, high_inclusive)`` -- ranges of float options (low always inclusive).
FLOAT_RANGES = {
    "lr": (0.0, None, False),
    "min_lr": (0.0, None, False),
    "clip_grad": (0.0, None, False),
    "weight_decay": (0.0, None, False),
    "init_method_std": (0.0, None, False),
    "attention_dropout": (0.0, 1.0, False),
    "hidden_dropout": (0.0, 1.0, False),
    "adam_beta1": (0.0, 1.0, False),
    "adam_beta2": (0.0, 1.0, False),
    "adam_eps": (0.0, None, False),
    "sgd_momentum": (0.0, None, False),
    "norm_epsilon": (0.0, None, False),
    "rotary_percent": (0.0, 1.0, True),
    "optimizer_offload_fraction": (0.0, 1.0, True),
    "initial_loss_scale": (0.0, None, False),
    "min_loss_scale": (0.0, None, False),
    "loss_scale": (0.0, None, False),
}


def _check_ranges(args: argparse.Namespace) -> None:
    for dest, (low, high, high_inclusive) in FLOAT_RANGES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        above = high is not None and (value > high if high_inclusive else value >= high)
        if value < low or above:
            bound = "" if high is None else f" and {'<=' if high_inclusive else '<'} {high:g}"
            raise ArgumentError(f"{flag} {value:g} is out of range: must be >= {low:g}{bound}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ArgumentError(
            f"--master-port {args.master_port} is not a TCP port",
            "give a port in 1..65535, or leave --master-port out to take a free one",
        )


#: what ``megatron-npu evaluate`` runs with when the training-only options are left out: one
#: step's worth of schedule at learning rate 0 (the optimizer is built only to load the
#: checkpoint), and Megatron-LM's zero-shot micro-batch of 8 passages
EVALUATE_DEFAULTS = {"train_iters": 1, "lr": 0.0, "micro_batch_size": 8}


def add_arguments(
    parser: argparse.ArgumentParser, command: str = "train"
) -> argparse.ArgumentParser:
    """Add every ``train`` option to ``parser`` (shared by ``megatron-npu train``, ``python -m
    megatron_npu.train`` and, with ``command="evaluate"``, ``megatron-npu evaluate``: the same
    model, layout and data options, the training-only ones optional, and its own group)."""
    training = command == "train"
    g = parser.add_argument_group("device and launch")
    g.add_argument(
        "--device",
        choices=DEVICE_NAMES,
        default=None,
        help="default: auto ($MEGATRON_NPU_DEVICE, else npu if torch_npu sees one, else cpu)",
    )
    g.add_argument(
        "--nproc-per-node",
        type=_positive,
        default=None,
        help="start this many ranks here through torch's elastic launcher "
        "(leave out under torchrun, which sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*)",
    )
    g.add_argument("--nnodes", type=_positive, default=1)
    g.add_argument("--node-rank", type=_non_negative, default=0)
    g.add_argument("--master-addr", default="127.0.0.1")
    g.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="default: a free port when --nnodes is 1, else 29500",
    )
    g.add_argument("--distributed-timeout-minutes", type=_positive, default=10)

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=_positive,
        default=None,
        help="interleaved pipeline schedule: layers per virtual stage",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--context-parallel-size",
        type=_positive,
        default=1,
        help="split each sequence over this many ranks (Megatron's load-balanced 2 x CP chunks); "
        "needs --transformer-impl transformer_engine",
    )
    g.add_argument(
        "--cp-comm-type",
        default="p2p",
        help="how the context-parallel ranks exchange keys and values: p2p (ring attention), "
        "a2a (all-to-all over heads), allgather, or a2a+p2p (with "
        "--hierarchical-context-parallel-sizes)",
    )
    g.add_argument(
        "--hierarchical-context-parallel-sizes",
        type=_positive,
        nargs=2,
        default=None,
        metavar=("A", "P"),
        help="a2a+p2p: an all-to-all within A consecutive context-parallel ranks, a ring over P "
        "(A x P = --context-parallel-size)",
    )
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive, required=True)
    g.add_argument("--hidden-size", type=_positive, required=True)
    g.add_argument(
        "--ffn-hidden-size",
        type=_positive,
        default=None,
        help="default 4 * hidden size (with --swiglu: int(8 * hidden / 3 / 64) * 64, as Megatron)",
    )
    g.add_argument("--num-attention-heads", type=_positive, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=_positive, default=1)
    g.add_argument("--kv-channels", type=_positive, default=None)
    g.add_argument("--seq-length", type=_positive, required=True)
    g.add_argument(
        "--max-position-embeddings", type=_positive, default=None, help="default: --seq-length"
    )
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
    )
    g.add_argument("--rotary-percent", type=_finite, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="the layer spec: Megatron's local modules, or its Transformer Engine spec (TE's "
        "layer names and checkpoint keys; the adaptor serves its classes without TE). "
        "Megatron-LM's own default is transformer_engine",
    )
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=_finite, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="normalise queries and keys per head (with --multi-latent-attention: the query and "
        "key/value latents) before attention",
    )
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=_finite, default=0.02)
    g.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        help="build the initial weights in host memory and move the model afterwards (Megatron's "
        "host path); default: allocate on the device",
    )
    g.add_argument(
        "--layout-independent-init",
        action="store_true",
        help="the same initial weights in every TP/PP/DP/EP layout and on every device, from one "
        "CPU stream re-seeded per layer (training/weight_init.py), for layout and device "
        "comparisons; default: Megatron-LM's initialisation, the weights pretrain_gpt.py draws "
        "with the same options",
    )
    g.add_argument("--attention-dropout", type=_finite, default=0.1)
    g.add_argument("--hidden-dropout", type=_finite, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=_positive, default=128)
    g.add_argument(
        "--vocab-size",
        type=_positive,
        default=None,
        help="the NullTokenizer's --vocab-size for --mock-data, as Megatron-LM takes it: the "
        "EOD token comes on top up to megatron-core 0.17, inside from 0.18 (default 512)",
    )

    g = parser.add_argument_group("activation recomputation (Megatron-LM's names and defaults)")
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: recompute whole layers in the backward pass (with --recompute-method and "
        "--recompute-num-layers); selective: only --recompute-modules of every layer; default: "
        "keep every activation",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Megatron-LM's short form of --recompute-granularity selective",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="full recomputation: uniform checkpoints groups of --recompute-num-layers layers; "
        "block recomputes the first --recompute-num-layers layers of each pipeline stage",
    )
    g.add_argument("--recompute-num-layers", type=_positive, default=None)
    g.add_argument(
        "--recompute-modules",
        nargs="+",
        choices=RECOMPUTE_MODULES,
        default=None,
        help="selective recomputation's modules (default: core_attn)",
    )
    g.add_argument(
        "--distribute-saved-activations",
        action="store_true",
        help="full recomputation under tensor parallelism: split each layer's saved input over "
        "the tensor-parallel ranks",
    )

    g = parser.add_argument_group("multi-latent attention (Megatron-LM's names and defaults)")
    g.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="DeepSeek-V2/V3's attention (megatron-core's MLASelfAttention; the Transformer "
        "Engine spec, as in Megatron-LM)",
    )
    g.add_argument("--q-lora-rank", type=_positive, default=None, help="default: no query LoRA")
    g.add_argument("--kv-lora-rank", type=_positive, default=32)
    g.add_argument("--qk-head-dim", type=_positive, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=_positive, default=64)
    g.add_argument("--v-head-dim", type=_positive, default=128)
    g.add_argument(
        "--rope-type",
        choices=("rope", "yarn"),
        default=None,
        help="default: yarn with --multi-latent-attention, rope otherwise",
    )
    g.add_argument("--rotary-scaling-factor", type=_finite, default=1.0)
    g.add_argument("--mscale", type=_finite, default=1.0)
    g.add_argument("--mscale-all-dim", type=_finite, default=0.0)

    g = parser.add_argument_group("mixture of experts (Megatron-LM's names and defaults)")
    g.add_argument(
        "--num-experts",
        type=_positive,
        default=None,
        help="experts per MoE layer (every layer is an MoE layer); default: a dense model",
    )
    g.add_argument("--moe-router-topk", type=_positive, default=2)
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=_positive,
        default=None,
        help="each expert's FFN size; default --ffn-hidden-size",
    )
    g.add_argument("--expert-model-parallel-size", type=_positive, default=1)
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=_positive,
        default=None,
        help="tensor parallelism inside each expert; default: the TP size (Megatron's default)",
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall"),
        default="allgather",
        help="how tokens reach their experts' ranks (Megatron's flex dispatcher needs DeepEP, "
        "which is CUDA-only)",
    )
    g.add_argument(
        "--moe-router-load-balancing-type",
        choices=("aux_loss", "seq_aux_loss", "none"),
        default="aux_loss",
    )
    g.add_argument("--moe-aux-loss-coeff", type=_finite, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=_finite, default=None)
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    g.add_argument("--moe-router-topk-scaling-factor", type=_finite, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument(
        "--moe-router-num-groups",
        type=_positive,
        default=None,
        help="group-limited routing: experts in this many groups ...",
    )
    g.add_argument(
        "--moe-router-group-topk",
        type=_positive,
        default=None,
        help="... of which each token may use this many",
    )
    g.add_argument(
        "--moe-router-dtype",
        choices=("fp32", "fp64"),
        default=None,
        help="the router's logits and probabilities in this dtype (default: the model's)",
    )
    g.add_argument(
        "--moe-layer-freq",
        default=1,
        help="which layers are MoE layers: N for every N-th layer (from the first), or a list "
        "expression of 0 (dense) and 1 (MoE) per layer such as '([1]*3+[0]*1)*2'",
    )
    g.add_argument("--moe-expert-capacity-factor", type=_finite, default=None)
    g.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="with a capacity factor: every expert gets exactly its capacity (padded)",
    )
    g.add_argument(
        "--moe-token-drop-policy",
        choices=("probs", "position"),
        default="probs",
        help="with a capacity factor: drop the lowest-probability tokens or the latest ones",
    )
    g.add_argument("--moe-shared-expert-intermediate-size", type=_positive, default=None)
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="all local experts as one grouped GEMM per direction (npu_grouped_matmul)",
    )
    g.add_argument(
        "--moe-router-fusion",
        action="store_true",
        help="the router's top-k fused (npu_moe_gating_top_k where its routing is Megatron's)",
    )
    g.add_argument(
        "--moe-permute-fusion",
        action="store_true",
        help="the dispatcher's token permutation fused (npu_moe_token_permute / unpermute)",
    )

    g = parser.add_argument_group(
        "fusions (Megatron-LM's flags and defaults; on npu / npu-emulated they route to the "
        "fused-op patches)"
    )
    g.add_argument(
        "--bias-swiglu-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --swiglu: fused bias-SwiGLU (npu_swiglu on the NPU)",
    )
    g.add_argument(
        "--bias-gelu-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="without --swiglu: fused bias-GeLU, tanh approximation (off with "
        "--disable-bias-linear, as in Megatron-LM)",
    )
    g.add_argument(
        "--masked-softmax-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp16/bf16 attention softmax through the fused scaled-masked softmax "
        "(npu_scaled_masked_softmax on the NPU) where the kernel's shape rule allows it",
    )
    g.add_argument(
        "--gradient-accumulation-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the weight gradient's GEMM accumulates into the fp32 main_grad in fp32 (the "
        "adaptor's kernel; apex's extension on cuda, off with one line where it is missing)",
    )
    g.add_argument(
        "--bias-dropout-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bias, dropout and residual add in one fused function",
    )

    g = parser.add_argument_group("fused attention (the Ascend guide's large-kernel options)")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--shape-order", choices=("SBH", "BSH"), default="SBH")
    g.add_argument("--pre-tokens", type=_non_negative, default=FULL_WINDOW)
    g.add_argument("--next-tokens", type=_non_negative, default=FULL_WINDOW)

    g = parser.add_argument_group("mixed precision")
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    g.add_argument(
        "--loss-scale",
        type=_finite,
        default=None,
        help="static loss scale for fp16 (default: dynamic loss scaling)",
    )
    g.add_argument("--initial-loss-scale", type=_finite, default=2.0**32)
    g.add_argument("--min-loss-scale", type=_finite, default=1.0)
    g.add_argument("--loss-scale-window", type=_finite, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="(always on with --bf16, as in Megatron)",
    )

    g = parser.add_argument_group("run")
    g.add_argument("--micro-batch-size", type=_positive, required=training)
    g.add_argument("--global-batch-size", type=_positive, default=None)
    g.add_argument("--train-iters", type=_positive, required=training)
    g.add_argument("--seed", type=int, default=DEFAULT_SEED)
    g.add_argument(
        "--init-ulp-nudge",
        type=int,
        default=0,
        metavar="K",
        help="move every initial weight K ulps of its dtype (negative: down) before training: a "
        "rounding-level perturbation, what compare's noise reruns measure (not with --load)",
    )
    g.add_argument(
        "--divergence-steps",
        type=_positive,
        default=5,
        metavar="N",
        help="stop the run (exit status 3) when the lm loss is NaN/inf for N consecutive steps",
    )
    g.add_argument(
        "--no-divergence-stop",
        dest="divergence_stop",
        action="store_false",
        help="keep training when the loss is NaN/inf, every step is skipped or the learning "
        "rate is 0 throughout (default: such a run stops with exit status 3)",
    )

    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=_finite, required=training)
    g.add_argument("--min-lr", type=_finite, default=0.0)
    g.add_argument("--lr-warmup-iters", type=_non_negative, default=0)
    g.add_argument("--lr-decay-iters", type=_positive, default=None)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--clip-grad", type=_finite, default=1.0)
    g.add_argument("--weight-decay", type=_finite, default=0.01)
    g.add_argument("--adam-beta1", type=_finite, default=0.9)
    g.add_argument("--adam-beta2", type=_finite, default=0.999)
    g.add_argument("--adam-eps", type=_finite, default=1e-8)
    g.add_argument("--sgd-momentum", type=_finite, default=0.9)
    g.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="Transformer Engine's precision-aware Adam (served without TE): the optimizer keeps "
        "the master weights and the moments in the dtypes below; needs "
        "--use-distributed-optimizer",
    )
    g.add_argument(
        "--main-grads-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="precision-aware optimizer: the gradient buffer's dtype (bf16 with --bf16 only)",
    )
    g.add_argument(
        "--main-params-dtype",
        choices=("fp32", "fp16"),
        default="fp32",
        help="precision-aware optimizer: the master weights' dtype (fp32 with --bf16 is kept "
        "as the bf16 params plus int16 remainders)",
    )
    for option, moment in (("--exp-avg-dtype", "first"), ("--exp-avg-sq-dtype", "second")):
        g.add_argument(
            option,
            choices=("fp32", "fp16", "bf16"),
            default="fp32",
            help=f"precision-aware optimizer: the dtype Adam's {moment} moment is stored in "
            "(fp16 scaled per tensor)",
        )
    g.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="megatron-core's hybrid optimizer: step part of the parameters on the host (torch's "
        "AdamW on fp32 copies); needs --use-precision-aware-optimizer",
    )
    g.add_argument(
        "--optimizer-offload-fraction",
        type=_finite,
        default=1.0,
        help="the share of the parameters' elements stepped on the host, first parameters first",
    )
    g.add_argument("--use-torch-optimizer-for-cpu-offload", action="store_true")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true")
    g.add_argument("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params")

    g = parser.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="indexed dataset prefix(es), optionally weighted: [W1] PREFIX1 [W2] PREFIX2 ...",
    )
    g.add_argument("--mock-data", action="store_true")
    g.add_argument(
        "--split",
        default=None,
        help="train/valid/test weights of --data-path (default 100,0,0: there is no evaluation "
        "loop, only the train split is read)",
    )
    g.add_argument("--data-cache-path", default=None)
    g.add_argument(
        "--tokenizer-type",
        # megatron_npu.data's tokenizers, and Megatron's NullTokenizer (what --mock-data uses;
        # --vocab-size sets its vocabulary)
        choices=(*TOKENIZER_TYPES, "NullTokenizer"),
        default=None,
        help="with --data-path (NullTokenizer: --mock-data only)",
    )
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument(
        "--default-corpus-dir",
        default=None,
        help="where the embedded default corpus is written when neither --data-path nor "
        "--mock-data is given (default: <--save or a temp dir>/default_corpus)",
    )

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=_positive, default=None)
    g.add_argument(
        "--ckpt-step",
        type=_positive,
        default=None,
        help="load this iteration from --load instead of the latest",
    )
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    g.add_argument(
        "--load-optional",
        action="store_true",
        help="start from scratch when --load holds no checkpoint (default: that is an error)",
    )
    g.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="on resume, take the LR/WD schedule from this command line, not the checkpoint",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="on resume, take the LR/WD schedule from the checkpoint, not this command line",
    )
    g.add_argument(
        "--no-safe-load",
        dest="safe_load",
        action="store_false",
        help="let --load unpickle arbitrary objects in the checkpoint's .metadata and "
        "object shards (default: only tensors, torch's checkpoint metadata and RNG states)",
    )
    g.add_argument(
        "--allow-unverified-load",
        action="store_true",
        help="load a checkpoint that has no megatron_npu_checkpoint.json manifest (Megatron-LM's "
        "own, or one whose manifest was removed): no checksum or model-fingerprint checks "
        "(default: refused)",
    )
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=_positive, default=100)
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--metrics-out", default=None, help="write run metrics JSON here (rank 0)")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-device peak TFLOP/s for MFU (default: $MEGATRON_NPU_PEAK_TFLOPS, else a GEMM "
        "probe cached in ~/.cache/megatron-npu/peak.json)",
    )
    g.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "none"),
        default="auto",
        help="progress display: rich bar on a TTY, plain lines otherwise (auto)",
    )
    if training:
        g = parser.add_argument_group("profiling (Megatron-LM's names and defaults)")
        g.add_argument(
            "--profile",
            action="store_true",
            help="profile a window of steps on the --profile-ranks, as Megatron-LM does: "
            "START+1..END (Nsight's capture range), or START..END-1 with "
            "--use-pytorch-profiler (from step 1)",
        )
        g.add_argument(
            "--use-pytorch-profiler",
            action="store_true",
            help="the torch profiler: a Chrome trace and a summary per rank in --profile-dir "
            "(without it: Nsight Systems' capture range on cuda, the torch profiler elsewhere)",
        )
        g.add_argument("--profile-step-start", type=_non_negative, default=10)
        g.add_argument("--profile-step-end", type=_non_negative, default=12)
        g.add_argument("--profile-ranks", type=_non_negative, nargs="+", default=[0])
        g.add_argument(
            "--profile-dir",
            default="profile",
            help="where the torch profiler's files go (default: ./profile)",
        )
        g.add_argument(
            "--record-memory-history",
            action="store_true",
            help="record the allocator's history from before the model is built and pickle a "
            "snapshot to --memory-snapshot-path at each logged step on the last rank, as "
            "Megatron-LM does (a host device keeps no history: its snapshots are empty)",
        )
        g.add_argument("--memory-snapshot-path", default="snapshot.pickle")
    if not training:
        parser.set_defaults(**EVALUATE_DEFAULTS)
        g = parser.add_argument_group("evaluation")
        g.add_argument("--task", choices=("lambada",), required=True)
        g.add_argument(
            "--valid-data",
            default="default",
            help="lambada_test.jsonl-format file, or 'default' (the shipped cloze set)",
        )
        g.add_argument(
            "--strict-lambada", action="store_true", help="the whole last word must match"
        )
        g.add_argument("--results-out", default=None, help="write the result as JSON here")
    return parser


class _Parser(argparse.ArgumentParser):
    """An option error is the usage in one line and the error line: train's full usage runs to
    about 130 lines, which would bury the line that names what was wrong (``--help`` still
    prints it all)."""

    def format_usage(self) -> str:
        return f"usage: {self.prog} [options] ({self.prog} --help lists them)\n"


def build_parser(command: str = "train") -> argparse.ArgumentParser:
    """The parser of ``megatron-npu train``, or of ``megatron-npu evaluate``."""
    descriptions = {
        "train": "GPT pretraining on Megatron-Core (GPTModel, local layer spec)",
        "evaluate": "zero-shot evaluation of a megatron-npu train checkpoint (LAMBADA)",
    }
    parser = _Parser(prog=f"megatron-npu {command}", description=descriptions[command])
    return add_arguments(parser, command)


def parse_args(argv: Sequence[str] | None = None, command: str = "train") -> argparse.Namespace:
    """The options of ``command`` (train or evaluate), checked; a bad one exits 2 naming it."""
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        check(args)
    except ArgumentError as exc:
        parser.error(str(exc))
    return args


def fused_attention_requests(args: argparse.Namespace) -> list[str]:
    """The options in ``args`` whose values only the fused attention kernel implements."""
    return FusedAttentionSettings(
        use_flash_attn=args.use_flash_attn,
        shape_order=args.shape_order,
        pre_tokens=args.pre_tokens,
        next_tokens=args.next_tokens,
    ).fused_only_options()


def fused_attention_patch_ids() -> list[str]:
    from megatron_npu.registry import all_patches

    return [p.id for p in all_patches() if p.id.startswith("attention.")]


def check_fused_attention(args: argparse.Namespace) -> None:
    """Fail when an option needs the fused attention kernel and the registry has no
    ``attention.*`` patch (keyed off the registry: adding the patch lifts the error)."""
    wants = fused_attention_requests(args)
    if wants and not fused_attention_patch_ids():
        verb = "needs" if len(wants) == 1 else "need"
        raise ArgumentError(
            f"{', '.join(wants)} {verb} the fused attention patch (attention.*), "
            "which this build does not have"
        )


#: the precision-aware optimizer's dtype options and their defaults
PRECISION_AWARE_DTYPES = {
    "main_grads_dtype": "fp32",
    "main_params_dtype": "fp32",
    "exp_avg_dtype": "fp32",
    "exp_avg_sq_dtype": "fp32",
}


#: the hybrid optimizer's options, under OptimizerConfig's names (every release 0.13+)
CPU_OFFLOAD_OPTIONS = (
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "use_torch_optimizer_for_cpu_offload",
    "overlap_cpu_optimizer_d2h_h2d",
    "pin_cpu_grads",
    "pin_cpu_params",
)


def _check_precision_aware(args: argparse.Namespace) -> None:
    """Megatron's own rules for the precision-aware optimizer, as one named error each."""
    changed = [
        "--" + name.replace("_", "-")
        for name, default in PRECISION_AWARE_DTYPES.items()
        if getattr(args, name) != default
    ]
    if args.optimizer_cpu_offload:
        changed.append("--optimizer-cpu-offload")
    if not args.use_precision_aware_optimizer:
        if changed:
            raise ArgumentError(f"{', '.join(changed)} need --use-precision-aware-optimizer")
        return
    if not args.use_distributed_optimizer or args.optimizer != "adam":
        raise ArgumentError(
            "--use-precision-aware-optimizer needs --use-distributed-optimizer and the adam "
            "optimizer"
        )
    if args.main_grads_dtype == "bf16" and not args.bf16:
        raise ArgumentError("--main-grads-dtype bf16 needs --bf16")
    if args.main_grads_dtype == "bf16" and args.accumulate_allreduce_grads_in_fp32:
        raise ArgumentError(
            "--main-grads-dtype bf16 and --accumulate-allreduce-grads-in-fp32 exclude each other"
        )
    for problem in offload_problems(args.optimizer_cpu_offload, args.bf16 or args.fp16):
        raise ArgumentError(problem)
    for problem in precision_aware_fp16_problems(
        True, args.fp16, args.accumulate_allreduce_grads_in_fp32, args.clip_grad
    ):
        raise ArgumentError(problem)


def check(args: argparse.Namespace) -> None:
    """World-size-independent rules (Megatron's ``validate_args`` where it applies)."""
    _check_ranges(args)
    for problem in sharded_optimizer_problems(
        args.optimizer, args.use_distributed_optimizer, args.optimizer_cpu_offload
    ):
        raise ArgumentError(problem)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ArgumentError("--max-position-embeddings must be >= --seq-length")
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--hidden-size must be divisible by --num-attention-heads")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 or 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.disable_bias_linear:  # Megatron-LM: no bias to fuse into the GeLU
        args.bias_gelu_fusion = False
    if args.recompute_activations:  # Megatron-LM's alias
        args.recompute_granularity = "selective"
    problems = recompute_problems_of(args)
    if problems:
        raise ArgumentError("; ".join(problems))
    if args.multi_latent_attention:
        if args.group_query_attention:  # Megatron-LM's own rule
            raise ArgumentError(
                "--group-query-attention is mutually exclusive with --multi-latent-attention"
            )
        if args.transformer_impl != "transformer_engine":
            raise ArgumentError(
                "--multi-latent-attention needs --transformer-impl transformer_engine: "
                "Megatron's local spec has none (its DotProductAttention takes no k_channels)"
            )
    elif args.rope_type not in (None, "rope"):  # Megatron-LM's own rule
        raise ArgumentError(
            f"--rope-type {args.rope_type}: attention other than multi-latent takes rope only"
        )
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups:
        raise ArgumentError("--num-attention-heads must be divisible by --num-query-groups")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        raise ArgumentError("--num-attention-heads must be divisible by the TP size")
    if args.num_query_groups % tp:
        raise ArgumentError("--num-query-groups must be divisible by the TP size")
    if args.ffn_hidden_size % tp:
        raise ArgumentError("--ffn-hidden-size must be divisible by the TP size")
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    try:  # Megatron's form: an int, or the list of 0 / 1 per layer
        pattern = moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    freq = str(args.moe_layer_freq).strip()
    args.moe_layer_freq = int(freq) if freq.isdigit() else pattern
    fused = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    if args.num_experts is not None and fused and not (args.swiglu and args.disable_bias_linear):
        flag = "--bias-swiglu-fusion" if args.swiglu else "--bias-gelu-fusion"
        raise ArgumentError(
            f"--num-experts with {flag}: megatron-core's experts weight their activation by the "
            "routing probabilities inside a fused SwiGLU without bias only; pass "
            f"--swiglu --disable-bias-linear, or --no-{flag[2:]}"
        )
    if args.moe_router_fusion and not _has_router_fusion():
        raise ArgumentError(
            "--moe-router-fusion: this megatron-core has no fused router (from 0.14)"
        )
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ArgumentError(
            "--moe-pad-expert-input-to-capacity: needs --moe-expert-capacity-factor"
        )
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        raise ArgumentError("--num-layers must be divisible by --pipeline-model-parallel-size")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if pp == 1:
            raise ArgumentError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            )
        per_stage = args.num_layers // pp
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ArgumentError(
                "layers per pipeline stage must be divisible by "
                "--num-layers-per-virtual-pipeline-stage"
            )
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron: SP means nothing without TP
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(
            "--seq-length must be divisible by the TP size with --sequence-parallel"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer")
    problems = context_parallel_problems(
        cp=args.context_parallel_size,
        comm_types=comm_types_of(args.cp_comm_type),
        transformer_impl=args.transformer_impl,
        seq_length=args.seq_length,
        heads=args.num_attention_heads,
        tp=tp,
        # GPT attention is causal, so only --pre-tokens narrows it (as the CP attention reads it)
        window=f"--pre-tokens {args.pre_tokens}" if args.pre_tokens < args.seq_length - 1 else None,
        hierarchical=args.hierarchical_context_parallel_sizes,
    )
    if problems:
        raise ArgumentError("; ".join(problems))
    _check_precision_aware(args)
    if args.bf16 and args.main_grads_dtype == "fp32":
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.loss_scale is not None and not args.fp16:
        raise ArgumentError("--loss-scale applies to --fp16 only")
    if args.data_path and args.mock_data:
        raise ArgumentError("--data-path and --mock-data exclude each other")
    if args.data_path and args.tokenizer_type in (None, "NullTokenizer"):
        raise ArgumentError(
            "--data-path needs --tokenizer-type (and its --vocab-file/--merge-file)"
        )
    if args.mock_data and args.tokenizer_type not in (None, "NullTokenizer"):
        raise ArgumentError("--mock-data uses Megatron's NullTokenizer (set --vocab-size)")
    if args.mock_data and args.vocab_size is None:
        args.vocab_size = 512
    if args.save_interval is not None and not args.save:
        raise ArgumentError("--save-interval needs --save")
    if args.ckpt_step is not None and not args.load:
        raise ArgumentError("--ckpt-step needs --load")
    if args.init_ulp_nudge and args.load:
        raise ArgumentError("--init-ulp-nudge moves initial weights; a --load run takes its own")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
            "exclude each other"
        )
    decay_defaulted = args.lr_decay_iters is None
    if decay_defaulted:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:  # Megatron's scheduler asserts on it
        decay = "--train-iters" if decay_defaulted else "--lr-decay-iters"
        raise ArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than {decay} "
            f"{args.lr_decay_iters} (the LR schedule warms up, then decays)",
            f"lower --lr-warmup-iters or raise {decay}",
        )
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr must be <= --lr")
    if getattr(args, "profile", False):
        _check_profile_window(args)
    if args.nnodes > 1 and args.nproc_per_node is None:
        raise ArgumentError("--nnodes needs --nproc-per-node (or launch with torchrun)")
    if args.node_rank >= args.nnodes:
        raise ArgumentError("--node-rank must be < --nnodes")
    check_fused_attention(args)


def profile_window(args: argparse.Namespace) -> range:
    """The steps (from 1) ``--profile`` records, as Megatron-LM's loop does. Its torch profiler
    (``--use-pytorch-profiler``: schedule wait START-1, warm-up 1, active END-START, stepped at
    the top of each iteration) records steps max(START, 1)..END-1; Nsight's capture range
    (started once START iterations are done, stopped once END are) records START+1..END."""
    start, end = args.profile_step_start, args.profile_step_end
    return range(max(start, 1), end) if args.use_pytorch_profiler else range(start + 1, end + 1)


def _check_profile_window(args: argparse.Namespace) -> None:
    """``--profile`` must record at least one step the run trains."""
    start, end = args.profile_step_start, args.profile_step_end
    if end <= start:
        raise ArgumentError(
            f"--profile-step-end {end} must be greater than --profile-step-start {start}"
        )
    window = profile_window(args)
    if not window or window[0] > args.train_iters:
        what = f"steps {window[0]}..{window[-1]}" if window else "no step"
        raise ArgumentError(
            f"--profile-step-start {start} --profile-step-end {end} records {what}, none of "
            f"--train-iters {args.train_iters}",
            "choose a window inside the run (see --profile's help)",
        )


def finalize(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive the sizes that depend on the world size (Megatron's names)."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    replicas = model_parallel * args.context_parallel_size  # one data-parallel replica's ranks
    if world_size % replicas:
        layout = "TP x PP" if args.context_parallel_size == 1 else "TP x PP x CP"
        raise ArgumentError(f"world size {world_size} is not divisible by {layout} = {replicas}")
    problems = moe_option_problems(
        num_experts=args.num_experts,
        topk=args.moe_router_topk,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        world_size=world_size,
        sequence_parallel=args.sequence_parallel,
    )
    if problems:
        raise ArgumentError("; ".join(problems))
    outside = sorted(r for r in getattr(args, "profile_ranks", ()) if r >= world_size)
    if getattr(args, "profile", False) and outside:
        raise ArgumentError(f"--profile-ranks {outside} are not ranks of a world of {world_size}")
    args.world_size = world_size
    args.data_parallel_size = world_size // replicas
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro batch size "
            f"x data-parallel size = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    if args.virtual_pipeline_model_parallel_size and (
        args.num_microbatches % args.pipeline_model_parallel_size
    ):
        raise ArgumentError(
            "the interleaved schedule needs the number of micro-batches "
            f"({args.num_microbatches}) divisible by the pipeline size"
        )
    if args.pipeline_model_parallel_size > 1 and args.num_microbatches < 1:
        raise ArgumentError("pipeline parallelism needs at least one micro-batch per step")
    return args


def _has_router_fusion() -> bool:
    """Whether the installed megatron-core's TransformerConfig has ``moe_router_fusion``."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return any(f.name == "moe_router_fusion" for f in dataclasses.fields(TransformerConfig))
