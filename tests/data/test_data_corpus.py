"""The embedded default corpus: real text, deterministic, cached, indexed, private files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

import megatron_npu.data.preprocess as preprocess_module
from megatron_npu.data import corpus
from megatron_npu.data.tokenizers import ByteLevelTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "default"
    return out, corpus.build_default_corpus(out)


def test_corpus_is_large_real_text_indexed_exactly(built):
    _, prefix = built
    ds = IndexedDataset(prefix)
    documents = corpus.default_corpus_documents()
    assert len(ds) == len(documents) > 150
    total = int(ds.sequence_lengths.sum())
    assert total > 200_000
    tok = ByteLevelTokenizer()
    for i in (0, len(documents) // 2, len(documents) - 1):
        name, text = documents[i]
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
        assert text.startswith(name)
    # mostly English prose, not binary noise
    sample = "".join(text for _, text in documents[:20])
    assert sum(c.isalpha() or c.isspace() for c in sample) / len(sample) > 0.8
    assert 1_000_000 <= sum(len(t) for _, t in documents) <= 3_000_000


def test_corpus_is_deterministic_across_processes(built, tmp_path):
    _, prefix = built
    again = corpus.build_default_corpus(tmp_path / "other")
    assert os.path.basename(again) == os.path.basename(prefix)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(again + ext, "rb").read()
    # a fresh interpreter (no torch, no megatron imported) assembles the same text
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = (
        "import sys; from megatron_npu.data import corpus; "
        "print(corpus.default_corpus_sha256()); print('megatron' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [corpus.default_corpus_sha256(), "False"]
    assert corpus.default_corpus_sha256()[:16] in os.path.basename(prefix)


def test_second_call_is_served_from_the_cache(built, monkeypatch):
    out, prefix = built
    before = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)}

    def must_not_run(*args, **kwargs):
        raise AssertionError("preprocess ran again")

    monkeypatch.setattr(preprocess_module, "preprocess", must_not_run)
    assert corpus.build_default_corpus(out) == prefix
    assert {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)} == before


def test_corpus_files_are_private(built):
    out, prefix = built
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750
    files = [f for f in os.listdir(out) if os.path.isfile(out / f)]
    assert sorted(os.path.splitext(f)[1] for f in files) == [".bin", ".idx", ".jsonl"]
    assert all(stat.S_IMODE(os.stat(out / f).st_mode) == 0o640 for f in files)
    jsonl = next(out / f for f in files if f.endswith(".jsonl"))
    records = [json.loads(line) for line in open(jsonl, encoding="utf-8")]
    assert [r["id"] for r in records] == [name for name, _ in corpus.default_corpus_documents()]
