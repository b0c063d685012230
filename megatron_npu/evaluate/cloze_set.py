"""The shipped LAMBADA-format cloze set, built from the embedded default corpus.

LAMBADA itself cannot be downloaded at run time, so ``lambada_default.jsonl`` (next to this
module) holds passages in the same format, cut from the stdlib-docstring corpus the default
training run reads: sentences of 40-120 characters (so a byte-level sample fits a 128-token
sequence), plain ASCII, whose last word is alphabetic and at least 4 letters long; the sentence's
final punctuation is dropped so the passage ends on its answer word, as LAMBADA's do. An evenly
spaced, deduplicated selection of :data:`SIZE` passages is kept, in corpus order.

Regenerate with ``python -m megatron_npu.evaluate.cloze_set`` (the corpus follows the Python's
stdlib docstrings, so another Python may give other passages; the shipped file is what tests and
``compare`` use).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from megatron_npu import console
from megatron_npu.evaluate.lambada import DEFAULT_DATA
from megatron_npu.files import write_private

SIZE = 200
MIN_CHARS, MAX_CHARS = 40, 120
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LAST_WORD = re.compile(r"^[A-Za-z]{4,}$")


def candidate_passages(documents: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for document in documents:
        for sentence in _SENTENCE_END.split(document):
            text = " ".join(sentence.split())
            if not text.endswith(".") or not text.isascii():
                continue
            text = text[:-1]
            if not MIN_CHARS <= len(text) <= MAX_CHARS or text in seen:
                continue
            words = text.split()
            if len(words) < 6 or not _LAST_WORD.match(words[-1]):
                continue
            seen.add(text)
            out.append(text)
    return out


def select(passages: list[str], size: int = SIZE) -> list[str]:
    if len(passages) <= size:
        return passages
    step = len(passages) / size
    return [passages[int(i * step)] for i in range(size)]


def build(path: str | Path = DEFAULT_DATA, size: int = SIZE) -> int:
    from megatron_npu.data.corpus import default_corpus_documents

    passages = select(candidate_passages(text for _, text in default_corpus_documents()), size)
    write_private(path, "".join(json.dumps({"text": t}) + "\n" for t in passages))
    return len(passages)


if __name__ == "__main__":
    console.say(f"wrote {build(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DATA)} passages")
