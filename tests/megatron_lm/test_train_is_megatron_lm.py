"""``megatron-npu train`` is Megatron-LM: with the same options on the same device it starts
from the weights ``pretrain_gpt.py`` draws, reads the same mock data in the same order and
computes the same loss at every step, bitwise (on cpu; the script is the Megatron-LM tag of
the installed release, unmodified, through ``run_script``; both on one host thread, since the
thread count changes a CPU GEMM's reduction order). Each step's learning rate is the one
compare reads from the script's log and TensorBoard scalars, to the printed digits.

Eight configurations, each with dropout and gradient accumulation (4 micro-batches a step): a
GPT on Megatron's device-path initialisation (its default), a Llama-style model (SwiGLU,
RMSNorm, RoPE, no biases, grouped-query attention, untied output layer) on the host path
(``--use-cpu-initialization``), DeepSeek-style multi-latent attention (query and key/value
latents with their norms, YaRN RoPE; the script's default RoPE fusion, train's unfused RoPE) on
Megatron-LM's Transformer Engine spec, the GPT with full activation recomputation, and the
Llama-style model on the TE spec recomputing attention, norms and MLP selectively (train
builds the recomputation into the model's config: ``tests/training/test_arguments.py``), and the
GPT in bf16 with the distributed optimizer, plain and with the precision-aware optimizer's
memory-saving recipe (bf16 grads and moments; Megatron-LM's fusions in both: the weight
gradients accumulate into main_grad in fp32), and (``tox -e extended``) that recipe with half
the optimizer offloaded to the host. Before train drew Megatron-LM's weights the first
loss already differed (7.05527 against 7.05538 on such a model).

The script's per-step losses are read from its TensorBoard scalars (``lm loss``, the fp32 value
of each iteration): its printed log line is a logging window's mean, and from core_v0.16 the
first iteration is logged without resetting the window's sums, so with ``--log-interval 1``
iteration 2 prints the mean of iterations 1 and 2."""

from __future__ import annotations

import pytest

from megatron_npu.compare import mlm_log, tensorboard_events
from tests.megatron_lm._client import MLA, PRECISION_AWARE, pretrain_gpt
from tests.training._runner import train

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

COMMON = (
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--vocab-size",
    "1024",
    "--mock-data",
    "--train-iters",
    "4",
    "--log-interval",
    "1",
    "--attention-dropout",
    "0.1",
    "--hidden-dropout",
    "0.1",
    "--seed",
    "1234",
    "--transformer-impl",
    "local",
)
LLAMA = (
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--untie-embeddings-and-output-weights",
    "--use-cpu-initialization",
)
#: DeepSeek-style multi-latent attention on Megatron-LM's default (Transformer Engine) spec,
#: with the latents' norms
MLA_TE = ("--transformer-impl", "transformer_engine", *MLA, "--qk-layernorm")
#: full recomputation, one layer per checkpoint (dropout's masks drawn again in the backward)
RECOMPUTE_FULL = (
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
)
#: selective recomputation of every module the TE spec offers a dense model without biases
RECOMPUTE_SELECTIVE = (
    *LLAMA,
    "--transformer-impl",
    "transformer_engine",
    "--recompute-granularity",
    "selective",
    "--recompute-modules",
    "core_attn",
    "layernorm",
    "mlp",
)
SCRIPT_ONLY = ("--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--eval-interval", "1000")


@pytest.mark.parametrize(
    "extra",
    [
        (),
        pytest.param(LLAMA, marks=pytest.mark.extended),  # tox -e extended
        MLA_TE,
        RECOMPUTE_FULL,
        pytest.param(RECOMPUTE_SELECTIVE, marks=pytest.mark.extended),
        ("--bf16", "--use-distributed-optimizer"),
        PRECISION_AWARE,
        pytest.param(
            (*PRECISION_AWARE, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"),
            marks=pytest.mark.extended,
        ),
    ],
    ids=[
        "gpt-device-init",
        "llama-host-init",
        "mla-te-spec",
        "recompute-full",
        "llama-te-recompute-selective",
        "bf16-distributed-optimizer",
        "bf16-precision-aware",
        "bf16-cpu-offload",
    ],
)
def test_train_computes_what_pretrain_gpt_computes(tmp_path, extra):
    ours = train(
        tmp_path / "train",
        "--device",
        "cpu",
        *COMMON,
        *extra,
        "--progress",
        "plain",
        env={"OMP_NUM_THREADS": "1"},
    )
    script = pretrain_gpt(tmp_path, *COMMON, *extra, *SCRIPT_ONLY)
    assert script.returncode == 0, script.tail()
    theirs = script.scalars("lm loss")
    assert sorted(ours.losses) == sorted(theirs) == [1, 2, 3, 4]
    assert len(set(theirs.values())) == 4  # it trained: every step's loss is its own
    assert ours.losses == theirs  # bitwise: TensorBoard holds the fp32 value
    norms = {s.step: round(s.grad_norm, 3) for s in ours.steps}
    assert norms == script.grad_norms  # as printed, three decimals
    # the learning rate each step used, as compare imports the script's log and its TensorBoard
    # scalars (which hold the rate after each step): train's own from step 2 (the script never
    # says which rate its first step used), equal to the printed digits
    used = {s.step: s.lr for s in ours.steps}
    assert len(set(used.values())) == 4  # linear decay: every step's rate is its own
    imported = (
        mlm_log.to_metrics(mlm_log.parse(tmp_path / "run.log"), "log"),
        tensorboard_events.to_metrics(tensorboard_events.read(script.tensorboard), "events"),
    )
    for metrics in imported:
        lr = {s.step: s.lr for s in metrics.steps}
        assert lr[1] is None
        assert {k: float(f"{v:.6E}") for k, v in lr.items() if k > 1} == {
            k: float(f"{v:.6E}") for k, v in used.items() if k > 1
        }
