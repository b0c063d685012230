"""Preprocessing to Megatron's indexed dataset: exact token ids, permissions, errors, CLI."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import stat

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_npu.data.preprocess import (
    PreprocessError,
    add_preprocess_args,
    preprocess,
    run_preprocess,
)
from megatron_npu.data.tokenizers import ByteLevelTokenizer, build_tokenizer

from ._util import write_jsonl, write_tiny_gpt2_files

TEXTS = [
    "The quick brown fox.",
    "",
    "Ünïcödé 中文 😀\nsecond line",
    "x" * 1000,
    "the end",
]


def _read_back(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    docs = []
    for d in range(len(ds.document_indices) - 1):
        lo, hi = int(ds.document_indices[d]), int(ds.document_indices[d + 1])
        docs.append([int(t) for i in range(lo, hi) for t in ds[i]])
    return docs


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_zero():
    """Run with umask 0 so only an explicit chmod can produce 0640/0750."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_jsonl_round_trip_exact_ids(tmp_path):
    tok = ByteLevelTokenizer()
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    summary = preprocess([src], tmp_path / "out" / "corpus", tok)
    prefix = str(tmp_path / "out" / "corpus_text_document")
    assert summary["prefix"] == prefix and summary["prefixes"] == {"text": prefix}
    assert summary["documents"] == len(TEXTS)
    assert summary["empty_documents"] == {"text": 1}
    expected = [tok.tokenize(t) + [tok.eod] if t else [] for t in TEXTS]
    assert summary["tokens"] == {"text": sum(map(len, expected))}
    assert summary["dtype"] == "uint16"
    assert _read_back(prefix) == expected
    ds = IndexedDataset(prefix)
    assert ds.index.dtype == np.uint16
    assert ds.sequence_lengths.tolist() == [len(e) for e in expected if e]
    assert sorted(os.listdir(tmp_path / "out")) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]


def test_gpt2_bpe_ids_and_no_eod(tmp_path):
    vocab, merges, _ = write_tiny_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    src = write_jsonl(tmp_path / "in.json", ["the theme", "is this"], key="body")
    summary = preprocess([src], tmp_path / "g", tok, json_key="body", append_eod=False)
    assert _read_back(summary["prefixes"]["body"]) == [
        tok.tokenize("the theme"),
        tok.tokenize("is this"),
    ]


def test_plain_text_one_document_per_paragraph(tmp_path):
    tok = ByteLevelTokenizer()
    src = tmp_path / "book.txt"
    src.write_text("First para\nstill first.\n\n\n  \nSecond para.\n\nThird", encoding="utf-8")
    summary = preprocess(
        [src, write_jsonl(tmp_path / "more.jsonl", ["fourth"])], tmp_path / "b", tok
    )
    paragraphs = ["First para\nstill first.", "Second para.", "Third", "fourth"]
    assert summary["documents"] == 4
    assert _read_back(summary["prefix"]) == [tok.tokenize(p) + [tok.eod] for p in paragraphs]


def test_multiple_keys_write_one_dataset_each(tmp_path):
    tok = ByteLevelTokenizer()
    src = tmp_path / "kv.jsonl"
    src.write_text('{"title": "T1", "text": "body one"}\n{"title": "T2", "text": "body two"}\n')
    summary = preprocess([src], tmp_path / "kv", tok, json_key=["title", "text"])
    assert _read_back(summary["prefixes"]["title"]) == [[84, 49, 256], [84, 50, 256]]
    assert _read_back(summary["prefixes"]["text"])[1] == tok.tokenize("body two") + [256]


def test_large_vocab_uses_int32(tmp_path):
    class BigVocab(ByteLevelTokenizer):
        @property
        def vocab_size(self):
            return 70_000

        def tokenize(self, text):
            return [69_000 + b for b in text.encode()]

    summary = preprocess([write_jsonl(tmp_path / "in.jsonl", ["ab"])], tmp_path / "big", BigVocab())
    assert summary["dtype"] == "int32"
    assert _read_back(summary["prefix"]) == [[69_097, 69_098, 256]]


def test_outputs_are_0640_and_created_dirs_0750(tmp_path, umask_zero):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    os.chmod(tmp_path, 0o755)
    summary = preprocess([src], tmp_path / "a" / "b" / "corpus", ByteLevelTokenizer())
    for path in summary["files"]:
        assert _mode(path) == 0o640, path
    assert _mode(tmp_path / "a") == 0o750 and _mode(tmp_path / "a" / "b") == 0o750
    assert _mode(tmp_path) == 0o755  # pre-existing directories are left alone


def test_permissions_do_not_depend_on_a_strict_umask(tmp_path):
    old = os.umask(0o077)
    try:
        summary = preprocess(
            [write_jsonl(tmp_path / "in.jsonl", TEXTS)], tmp_path / "c", ByteLevelTokenizer()
        )
    finally:
        os.umask(old)
    assert all(_mode(p) == 0o640 for p in summary["files"])


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    "lines, lineno, message",
    [
        (['{"text": "ok"}', '{"text": "broken"', '{"text": "ok"}'], 2, "malformed JSON"),
        (['{"text": "ok"}', "", '{"txt": "no key"}'], 3, "missing key 'text'"),
        (['["a", "list"]'], 1, "expected a JSON object"),
        (['{"text": "ok"}', '{"text": 42}'], 2, "must be a string"),
    ],
)
def test_bad_jsonl_names_file_and_line_and_leaves_nothing(
    tmp_path, workers, lines, lineno, message
):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(PreprocessError) as info:
        preprocess([src], tmp_path / "out" / "x", ByteLevelTokenizer(), workers=workers)
    assert str(info.value).startswith(f"{src}:{lineno}: ")
    assert message in str(info.value)
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("name", ["in.jsonl.gz", "in.txt.gz"])
def test_a_gzip_input_writes_what_its_content_writes(tmp_path, name):
    """A compressed corpus (JSON Lines or plain text) gives the same dataset files, byte for
    byte, as the same file uncompressed; a damaged archive is one error naming the file."""
    tok = ByteLevelTokenizer()
    plain = tmp_path / name.removesuffix(".gz")
    if name.startswith("in.jsonl"):
        write_jsonl(plain, TEXTS)
    else:
        plain.write_text("first paragraph\nstill first\n\nsecond\n", encoding="utf-8")
    packed = tmp_path / name
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for source, out in ((plain, "a"), (packed, "b")):
        preprocess([source], tmp_path / out / "corpus", tok)
    for suffix in (".bin", ".idx"):
        a, b = (tmp_path / d / f"corpus_text_document{suffix}" for d in ("a", "b"))
        assert a.read_bytes() == b.read_bytes()
    damaged = tmp_path / f"cut-{name}"
    damaged.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(PreprocessError, match=rf"^{damaged}:\d+: a damaged gzip file \("):
        preprocess([damaged], tmp_path / "c" / "corpus", tok)


def test_invalid_utf8_names_the_line(tmp_path):
    src = tmp_path / "bin.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "bad \xff byte"}\n')
    with pytest.raises(PreprocessError, match=rf"^{src}:2: not valid UTF-8"):
        preprocess([src], tmp_path / "x", ByteLevelTokenizer())


def test_missing_input_file(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ["a"])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PreprocessError, match=rf"^{missing}: input file not found"):
        preprocess([good, missing], tmp_path / "out" / "x", ByteLevelTokenizer())
    assert not (tmp_path / "out").exists()


def test_workers_produce_identical_files(tmp_path):
    texts = [f"document {i} " + "lorem ipsum " * (i % 7) for i in range(300)]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    vocab, merges, _ = write_tiny_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    one = preprocess([src], tmp_path / "w1", tok, workers=1)
    two = preprocess([src], tmp_path / "w2", tok, workers=2)
    for a, b in zip(one["files"], two["files"], strict=True):
        assert open(a, "rb").read() == open(b, "rb").read()


def test_cli_arguments(tmp_path):
    vocab, merges, _ = write_tiny_gpt2_files(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", ["the theme", "this"])
    parser = add_preprocess_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--input",
            src,
            "--output-prefix",
            str(tmp_path / "cli"),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab,
            "--merge-file",
            merges,
            "--json-keys",
            "text",
        ]
    )
    summary = run_preprocess(args)
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert _read_back(summary["prefix"]) == [
        tok.tokenize("the theme") + [tok.eod],
        tok.tokenize("this") + [tok.eod],
    ]
    json.dumps(summary)  # the CLI prints it
    bad = parser.parse_args(
        ["--input", src, "--output-prefix", "p", "--tokenizer-type", "BertWordPieceCase"]
    )
    with pytest.raises(PreprocessError, match="vocab-file"):
        run_preprocess(bad)
