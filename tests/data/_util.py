"""Shared helpers for the data-pipeline tests."""

from __future__ import annotations

import json
import os

from megatron_npu.data.tokenizers import bytes_to_unicode


def write_jsonl(path: os.PathLike | str, texts: list[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": i, key: text}) + "\n")
    return os.fspath(path)


def write_tiny_gpt2_files(directory: os.PathLike | str) -> tuple[str, str, dict[str, int]]:
    """A GPT-2 style vocab.json/merges.txt: all 256 byte symbols, a few merges, <|endoftext|>."""
    symbols = list(bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("t", "he"), ("i", "s"), ("Ġ", "is")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_path = os.path.join(directory, "vocab.json")
    merges_path = os.path.join(directory, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as handle:
        json.dump(vocab, handle, ensure_ascii=False)
    with open(merges_path, "w", encoding="utf-8") as handle:
        handle.write("#version: 0.2\n")
        for a, b in merges:
            handle.write(f"{a} {b}\n")
    return vocab_path, merges_path, vocab


BERT_VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "hello",
    "world",
    "the",
    "un",
    "##aff",
    "##able",
    "play",
    "##ing",
    "##s",
    ",",
    "!",
    ".",
    "-",
    "中",
    "文",
    "cafe",
    "Hello",
]


def write_bert_vocab(directory: os.PathLike | str) -> str:
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(BERT_VOCAB) + "\n")
    return path
