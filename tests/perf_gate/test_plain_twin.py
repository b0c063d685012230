"""The yardstick of the GPU check's fairness figure (``perf/plain_gpt.py``) is the run it is held
against: the same model, batch split and dropout, read from the run's own options. Checked here
against Megatron-Core's model and against the native Megatron-LM log of the GPT-345M shape."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from megatron_npu.compare import matrix, mlm_log
from megatron_npu.compare.matrix import option_argv
from megatron_npu.training.options import TrainOptions
from perf import gpu_check
from perf.plain_gpt import GPTShape, PlainGPT, PlainTrainer, twin_of

H100_345M_LOG = (
    Path(__file__).resolve().parents[3]
    / "shared"
    / "gpu-logs"
    / "h100-gpt345m"
    / "mlm-native-bf16.log"
)

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
    "--vocab-size", "200", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--use-flash-attn",
]  # fmt: skip


def test_the_fairness_row_is_the_345m_shape_of_the_native_log():
    """The row's plain twin against the argument dump of Megatron-LM's own H100 run of GPT-345M
    (the shape the row names): layers, width, heads, sequence, padded vocabulary, micro-batch,
    micro-batches and bf16; its dropout is the row's (the matrix's defaults)."""
    assert H100_345M_LOG.is_file(), f"{H100_345M_LOG} is missing (the clone sits beside shared/)"
    native = mlm_log.parse(H100_345M_LOG)
    args = native["arguments"]
    twin = gpu_check.fairness_twin(gpu_check.MATRIX, "meta")
    row = next(r for r in matrix.load(gpu_check.MATRIX).runs if r.name == gpu_check.FAIRNESS_RUN)
    options = TrainOptions.parse(option_argv(row.options)).args
    assert twin.shape == GPTShape(
        num_layers=args["num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        seq_length=args["seq_length"],
        vocab_size=native["padded_vocab_size"],
        micro_batch_size=args["micro_batch_size"],
        attention_dropout=options.attention_dropout,
        hidden_dropout=options.hidden_dropout,
    )
    assert twin.micro_batches == args["global_batch_size"] // args["micro_batch_size"] == 2
    assert twin.dtype == (torch.bfloat16 if args["bf16"] else torch.float32)


def test_the_plain_model_holds_megatrons_weights(gloo_world_of_one, cpu_adaptor):
    """Parameter for parameter (shapes, as a multiset) the plain GPT is Megatron-Core's GPTModel
    on the local spec with train's defaults."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = GPTShape(3, 64, 4, 32, 256, 2)
    megatron = GPTModel(
        config=TransformerConfig(
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads,
            use_cpu_initialization=True,
        ),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        share_embeddings_and_output_weights=True,  # train's default: tied
    )
    shapes = Counter(tuple(p.shape) for p in megatron.parameters())
    assert shapes == Counter(tuple(p.shape) for p in PlainGPT(shape).parameters())


def test_micro_batches_accumulate_to_the_whole_batch():
    """Two micro-batches of 2 take the same step as one micro-batch of the same 4 sequences."""
    split = PlainTrainer(GPTShape(2, 32, 4, 16, 128, 2), torch.float32, micro_batches=2)
    whole = PlainTrainer(GPTShape(2, 32, 4, 16, 128, 4), torch.float32)
    torch.testing.assert_close(split.tokens.flatten(0, 1), whole.tokens.flatten(0, 1))
    assert split.step() == pytest.approx(whole.step(), rel=1e-6)
    for a, b in zip(split.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["--attention-dropout", "--hidden-dropout"])
def test_each_dropout_reaches_the_step(kind):
    """Each kind of dropout alone moves the first loss off the dropout-free one, which repeats."""
    off = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    none = twin_of(TINY + off).step()
    assert twin_of(TINY + off).step() == none
    assert twin_of(TINY + off + [kind, "0.3"]).step() != none


def test_a_row_without_flash_attention_is_named():
    argv = [a for a in TINY if a != "--use-flash-attn"]
    with pytest.raises(ValueError, match="no --use-flash-attn"):
        twin_of(argv)


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--swiglu"], "--swiglu"),
        (["--normalization", "RMSNorm"], "--normalization"),
        (["--position-embedding-type", "rope"], "--position-embedding-type"),
        (["--group-query-attention", "--num-query-groups", "2"], "--group-query-attention"),
        (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights"),
        (["--disable-bias-linear"], "--disable-bias-linear"),
        (["--kv-channels", "8"], "--kv-channels"),
        (["--max-position-embeddings", "64"], "--max-position-embeddings"),
        (["--num-experts", "2", "--no-bias-gelu-fusion"], "--num-experts"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--nproc-per-node", "2"], "--nproc-per-node/--nnodes"),
        (["--fp16"], "--fp16"),
        (["--optimizer", "sgd"], "--optimizer sgd"),
        (["--clip-grad", "0"], "--clip-grad other than 1.0"),
    ],
)
def test_a_model_it_does_not_write_is_named(extra, named):
    with pytest.raises(ValueError, match=f"does not write a model with {named}"):
        twin_of(TINY + extra)
