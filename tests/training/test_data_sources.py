"""Real text instead of mock tokens: the embedded default corpus (neither --data-path nor
--mock-data), and ``megatron-npu preprocess`` output read through --data-path."""

from __future__ import annotations

import json

import pytest

from megatron_npu import cli

from ._runner import train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SMALL = [
    "--device",
    "cpu",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "16",
    "--log-interval",
    "5",
    "--progress",
    "plain",
]


def test_default_corpus_loss_falls(train_tmp):
    run = train(
        train_tmp,
        *SMALL,
        "--train-iters",
        "25",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "3",
        "--default-corpus-dir",
        str(train_tmp / "corpus"),
        name="default-corpus",
    )
    config = run.metrics.config
    assert config.data.source == "default-corpus"
    assert config.padded_vocab_size >= 257  # bytes + EOD, padded
    losses = [s.lm_loss for s in run.steps]
    assert len(losses) == 25
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses


def test_preprocess_then_train_on_data_path(train_tmp, capsys):
    corpus = train_tmp / "docs.jsonl"
    with corpus.open("w", encoding="utf-8") as handle:
        for i in range(200):
            text = f"Document {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 4)
            handle.write(json.dumps({"text": text}) + "\n")
    prefix = train_tmp / "docs"
    assert (
        cli.main(
            [
                "preprocess",
                "--input",
                str(corpus),
                "--output-prefix",
                str(prefix),
                "--tokenizer-type",
                "ByteLevel",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    data_prefix = f"{prefix}_text_document"
    run = train(
        train_tmp,
        *SMALL,
        "--train-iters",
        "6",
        "--lr",
        "3e-3",
        "--data-path",
        data_prefix,
        "--tokenizer-type",
        "ByteLevel",
        "--data-cache-path",
        str(train_tmp / "index-cache"),
        name="data-path",
    )
    assert run.metrics.config.data.source == "data-path"
    losses = [s.lm_loss for s in run.steps]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_train_on_a_weighted_blend_of_two_preprocessed_prefixes(train_tmp, capsys):
    prefixes = []
    for name, phrase in (("alpha", "alpha beta gamma. "), ("omega", "zeta eta theta iota. ")):
        corpus = train_tmp / f"{name}.jsonl"
        with corpus.open("w", encoding="utf-8") as handle:
            for i in range(120):
                handle.write(json.dumps({"text": f"{name} {i}: " + phrase * (2 + i % 5)}) + "\n")
        assert (
            cli.main(
                [
                    "preprocess",
                    "--input",
                    str(corpus),
                    "--output-prefix",
                    str(train_tmp / name),
                    "--tokenizer-type",
                    "ByteLevel",
                ]
            )
            == 0
        )
        prefixes.append(f"{train_tmp / name}_text_document")
    capsys.readouterr()
    run = train(
        train_tmp,
        *SMALL,
        "--train-iters",
        "6",
        "--lr",
        "3e-3",
        "--data-path",
        "0.7",
        prefixes[0],
        "0.3",
        prefixes[1],
        "--tokenizer-type",
        "ByteLevel",
        "--data-cache-path",
        str(train_tmp / "blend-cache"),
        name="blend",
    )
    assert run.metrics.config.data.source == "data-path"
    description = run.metrics.config.data.description
    assert f"0.7 {prefixes[0]} 0.3 {prefixes[1]}" in description  # proportions: tests/data
    losses = [s.lm_loss for s in run.steps]
    assert len(losses) == 6 and losses[-1] < losses[0]
