"""GPT dataset building on top of the indexed data, with and without torch.distributed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from megatron_npu.data import index_helpers
from megatron_npu.data.datasets import build_gpt_datasets, parse_data_path
from megatron_npu.data.preprocess import preprocess
from megatron_npu.data.tokenizers import ByteLevelTokenizer

from ._util import write_jsonl

SEQ = 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _documents(n: int, alphabet: str, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), size=int(rng.integers(1, 60)))) for _ in range(n)]


def _make_dataset(directory, name: str, texts: list[str]) -> str:
    src = write_jsonl(os.path.join(directory, f"{name}.jsonl"), texts)
    return preprocess([src], os.path.join(directory, name), ByteLevelTokenizer())["prefix"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gptdata")
    lower = _documents(120, "abcdefghij ", seed=0)
    upper = _documents(80, "KLMNOPQRST ", seed=1)
    return {
        "lower": (_make_dataset(directory, "lower", lower), lower),
        "upper": (_make_dataset(directory, "upper", upper), upper),
    }


def _doc_tokens(texts: list[str]) -> list[list[int]]:
    tok = ByteLevelTokenizer()
    return [tok.tokenize(t) + [tok.eod] for t in texts]


def _assert_consecutive_slices(dataset, texts):
    """Sample j is tokens [s*SEQ, s*SEQ + SEQ + 1) of the documents concatenated in the dataset's
    document order, where s = shuffle_index[j]; tokens/labels are that window shifted by one."""
    docs = _doc_tokens(texts)
    stream = np.concatenate([docs[d] for d in np.asarray(dataset.document_index)])
    assert len(dataset) == len(dataset.shuffle_index) == dataset.sample_index.shape[0] - 1
    covered = set()
    for j in range(len(dataset)):
        s = int(dataset.shuffle_index[j])
        window = stream[s * SEQ : s * SEQ + SEQ + 1]
        sample = dataset[j]
        assert sample["tokens"].tolist() == window[:-1].tolist(), j
        assert sample["labels"].tolist() == window[1:].tolist(), j
        covered.add(s)
    assert covered == set(range(len(dataset)))


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path("a") == (["a"], None)
    assert parse_data_path([0.3, "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])


def test_gpt_samples_are_consecutive_document_slices(corpora, monkeypatch):
    prefix, texts = corpora["lower"]
    calls = []
    real = index_helpers._REPLACEMENTS["build_sample_idx"]

    def counting(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setitem(index_helpers._REPLACEMENTS, "build_sample_idx", counting)
    train, valid, test = build_gpt_datasets([prefix], SEQ, 1234, ByteLevelTokenizer(), 100)
    assert calls == [SEQ]  # the numpy helper built the sample index
    assert valid is None and test is None
    assert not index_helpers.numpy_helpers_installed()  # installed only for the build
    assert sorted(np.asarray(train.document_index).tolist()) == list(range(len(texts)))
    _assert_consecutive_slices(train, texts)


def test_multiple_epochs_and_splits(corpora, tmp_path):
    prefix, texts = corpora["lower"]
    tokens = sum(map(len, _doc_tokens(texts)))
    many = 3 * tokens // SEQ  # forces several epochs
    train, valid, test = build_gpt_datasets(
        [prefix],
        SEQ,
        7,
        ByteLevelTokenizer(),
        many,
        10,
        10,
        split="80,10,10",
        path_to_cache=tmp_path / "cache",
    )
    assert len(train) >= many
    n_train = int(round(0.8 * len(texts)))
    assert set(np.asarray(train.document_index).tolist()) == set(range(n_train))
    assert set(np.asarray(valid.document_index).tolist()) <= set(range(n_train, len(texts)))
    assert len(valid) > 0 and len(test) > 0
    assert any(f.endswith("sample_index.npy") for f in os.listdir(tmp_path / "cache"))
    # the cached indices are reused: same samples on a second build
    again, _, _ = build_gpt_datasets(
        [prefix],
        SEQ,
        7,
        ByteLevelTokenizer(),
        many,
        10,
        10,
        split="80,10,10",
        path_to_cache=tmp_path / "cache",
    )
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, len(train), 7))


def test_blend_draws_in_proportion_to_weights(corpora):
    lower, _ = corpora["lower"]
    upper, _ = corpora["upper"]
    train, _, _ = build_gpt_datasets([0.3, lower, 0.7, upper], SEQ, 5, ByteLevelTokenizer(), 2000)
    assert len(train) == 2000
    ids = np.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert abs(np.mean(ids == 0) - 0.3) < 0.01
    for i in range(0, 2000, 37):  # the sample content comes from the named dataset
        text = bytes(t for t in train[i]["tokens"].tolist() if t < 256).decode()
        letters = {c for c in text if c != " "}
        assert letters <= (set("abcdefghij") if ids[i] == 0 else set("KLMNOPQRST")), text


def test_blend_without_distributed_ignores_cache_path_with_warning(corpora, tmp_path):
    lower, _ = corpora["lower"]
    upper, _ = corpora["upper"]
    with pytest.warns(RuntimeWarning, match="path_to_cache is not used"):
        train, _, _ = build_gpt_datasets(
            ["1", lower, "1", upper], SEQ, 5, ByteLevelTokenizer(), 50, path_to_cache=tmp_path
        )
    assert len(train) == 50 and os.listdir(tmp_path) == []


def test_mock_dataset():
    train, valid, test = build_gpt_datasets(None, SEQ, 1, ByteLevelTokenizer(), 64, 8, 8, mock=True)
    for ds in (train, valid, test):
        sample = ds[0]
        assert sample["tokens"].shape == (SEQ,) and sample["labels"].shape == (SEQ,)
        assert int(sample["tokens"].max()) < 257


def test_missing_prefix_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        build_gpt_datasets([str(tmp_path / "nothing_here")], SEQ, 1, ByteLevelTokenizer(), 10)


def test_works_without_compiled_helpers(corpora, monkeypatch):
    import megatron.core.datasets as pkg

    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers", None)
    monkeypatch.delattr(pkg, "helpers", raising=False)
    lower, texts = corpora["lower"]
    train, _, _ = build_gpt_datasets(
        [1, lower, 1, corpora["upper"][0]], SEQ, 3, ByteLevelTokenizer(), 300
    )
    assert len(train) == 300
    assert sys.modules["megatron.core.datasets.helpers"] is None  # stand-in removed again


def test_with_torch_distributed_initialised(corpora, tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    cache = tmp_path / "cache"
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        lower, texts = corpora["lower"]
        upper, _ = corpora["upper"]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="path_to_cache is not used")
            train, _, _ = build_gpt_datasets(
                [0.5, lower, 0.5, upper], SEQ, 9, ByteLevelTokenizer(), 200, path_to_cache=cache
            )
        single, _, _ = build_gpt_datasets([lower], SEQ, 9, ByteLevelTokenizer(), 50)
    finally:
        dist.destroy_process_group()
    assert len(train) == 200
    assert any("BlendedDataset" in f for f in os.listdir(cache))
    assert all(oct(os.stat(cache / f).st_mode & 0o777) == "0o640" for f in os.listdir(cache))
    _assert_consecutive_slices(single, texts)


_RANK_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    rank, world, store, cache, lower, upper, out = sys.argv[1:]
    dist.init_process_group("gloo", init_method=f"file://{store}",
                            rank=int(rank), world_size=int(world))
    from megatron_npu.data.datasets import build_gpt_datasets
    from megatron_npu.data.tokenizers import ByteLevelTokenizer
    train, _, _ = build_gpt_datasets([0.4, lower, 0.6, upper], 16, 11, ByteLevelTokenizer(), 120,
                                     path_to_cache=cache)
    torch.save(torch.stack([train[i]["tokens"] for i in range(len(train))]), out)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.multiprocess
def test_two_ranks_build_identical_datasets(corpora, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PYTHONWARNINGS"] = "ignore"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(rank),
                "2",
                str(tmp_path / "store"),  # a file store: no port to race for
                str(tmp_path / "cache"),
                corpora["lower"][0],
                corpora["upper"][0],
                str(tmp_path / f"out{rank}.pt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    a, b = torch.load(tmp_path / "out0.pt"), torch.load(tmp_path / "out1.pt")
    assert a.shape == (120, 16) and torch.equal(a, b)


def test_corrupted_index_is_a_named_error(tmp_path):
    from megatron_npu.data.datasets import build_gpt_datasets
    from megatron_npu.training.errors import TrainingInputError
    from tests.faults._harness import write_indexed_dataset

    prefix = write_indexed_dataset(tmp_path / "corpus")
    with open(f"{prefix}.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(TrainingInputError, match=r"corpus\.bin: truncated: 10 bytes"):
        build_gpt_datasets([str(prefix)], 16, 1234, tokenizer=None, train_samples=4)
