"""LAMBADA zero-shot cloze data, as Megatron-LM's ``tasks/zeroshot_gpt`` reads it.

File format: the public ``lambada_test.jsonl`` -- one JSON object per line with a ``"text"``
passage whose last word is the answer. Megatron-LM's rules, followed here:

* **non-strict** (default): tokenize the whole passage; the context is every token but the last,
  the target is the last *token* (with a byte-level or BPE tokenizer, possibly only part of the
  last word);
* **strict** (``--strict-lambada``): the last word is ``text.split()[-1]``; the context is the
  passage up to its last occurrence, stripped, tokenized on its own; the target is the
  tokenization of ``" " + last word`` (all of its tokens must be predicted);
* no detokenizer is applied to LAMBADA (Megatron-LM's ``lambada`` detokenizer is the identity);
* a sample is ``context + target`` padded with the tokenizer's EOD id to ``seq_length + 1``; the
  model reads tokens ``[:-1]`` and is scored on labels ``[1:]`` where the mask marks the target;
* a passage is correct when *every* target token is the model's argmax (the product over the
  target); accuracy = correct / number of passages.

One extension, because Megatron-LM would fail to batch it: a sample longer than
``seq_length + 1`` keeps its last ``seq_length + 1`` tokens (the context is cut on the left; the
target is never cut). The count of such samples is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DEFAULT_DATA = Path(__file__).with_name("lambada_default.jsonl")
#: What a result is called: ``lambada`` only for a user's ``lambada_test.jsonl``-format file (the
#: LAMBADA test set); the shipped file is a cloze set cut from the embedded corpus, not LAMBADA.
LAMBADA_SET, CORPUS_CLOZE_SET = "lambada", "corpus-cloze"
SET_TITLES = {
    LAMBADA_SET: "LAMBADA",
    CORPUS_CLOZE_SET: "the corpus cloze set (LAMBADA format, cut from the embedded corpus)",
}


def set_name(data: str | Path | None) -> str:
    """:data:`CORPUS_CLOZE_SET` for the shipped default data, else :data:`LAMBADA_SET`."""
    if data is None or str(data) == "default":
        return CORPUS_CLOZE_SET
    try:
        return CORPUS_CLOZE_SET if Path(data).resolve() == DEFAULT_DATA.resolve() else LAMBADA_SET
    except OSError:
        return LAMBADA_SET


class LambadaDataError(ValueError):
    """A LAMBADA file that cannot be read; the message names the file and line."""


class Tokenizer(Protocol):
    def tokenize(self, text: str) -> list[int]: ...

    @property
    def eod(self) -> int: ...


@dataclass(frozen=True)
class Sample:
    tokens: list[int]  # seq_length + 1 ids
    mask: list[int]  # seq_length: 1 where labels[i] (= tokens[i + 1]) is a target token
    truncated: bool


def read_passages(path: str | Path) -> list[str]:
    """The ``text`` of every line of a ``lambada_test.jsonl``-format file."""
    path = DEFAULT_DATA if str(path) == "default" else Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise LambadaDataError(f"cannot read LAMBADA data {path}: {exc.strerror or exc}") from None
    passages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise LambadaDataError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.split():
            raise LambadaDataError(f'{path}:{number}: needs a non-empty "text" string')
        passages.append(text)
    if not passages:
        raise LambadaDataError(f"{path}: no passages")
    return passages


def split_passage(text: str, tokenizer: Tokenizer, strict: bool) -> tuple[list[int], list[int]]:
    """(context ids, target ids) under Megatron-LM's strict / non-strict rule."""
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + last_word)


def build_sample(context: list[int], target: list[int], seq_length: int, pad: int) -> Sample:
    tokens = context + target
    mask = [0] * len(context) + [1] * len(target)
    truncated = len(tokens) > seq_length + 1
    if truncated:
        tokens, mask = tokens[-(seq_length + 1) :], mask[-(seq_length + 1) :]
    missing = seq_length + 1 - len(tokens)
    tokens = tokens + [pad] * missing
    mask = mask + [0] * missing
    return Sample(tokens, mask[1:], truncated)


def build_samples(
    passages: list[str], tokenizer: Tokenizer, seq_length: int, strict: bool
) -> list[Sample]:
    return [
        build_sample(*split_passage(text, tokenizer, strict), seq_length, tokenizer.eod)
        for text in passages
    ]
