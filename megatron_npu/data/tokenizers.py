"""Tokenizers for the GPT data pipeline, with no dependency beyond the standard library.

Three tokenizers, built by :func:`build_tokenizer` under Megatron's ``--tokenizer-type`` names:

* ``ByteLevel`` (:class:`ByteLevelTokenizer`): UTF-8 bytes are ids 0-255, EOD is 256. Needs no file.
* ``GPT2BPETokenizer`` (:class:`GPT2BPETokenizer`): GPT-2 byte-level BPE from ``vocab.json`` +
  ``merges.txt``; EOD is ``<|endoftext|>``.
* ``BertWordPieceLowerCase`` / ``BertWordPieceCase`` (:class:`BertWordPieceTokenizer`): BERT's
  basic tokenizer + greedy longest-match-first WordPiece from a ``vocab.txt``; EOD is ``[SEP]``.

All subclass megatron-core 0.16.1's abstract :class:`megatron.core.tokenizers.MegatronTokenizerBase`
(the type of ``BlendedMegatronDatasetConfig.tokenizer``) and provide what megatron-core's datasets
read from ``config.tokenizer``: ``eod``, ``vocab_size``, ``pad`` (raising ``NotImplementedError``
where the vocabulary has no pad token, which makes GPTDataset fall back to its -1 pad id), and
``unique_identifiers`` (an ``OrderedDict`` serialized into the dataset cache key, so it contains
only stable values: class name, file paths and options).

The GPT-2 pre-tokenizer regex uses ``\\p{L}`` and ``\\p{N}``, which the standard ``re`` module
lacks (the ``regex`` package is not a dependency). :func:`gpt2_pretokenize_pattern` builds the same
pattern with ``re`` by expanding the two classes into explicit code-point ranges taken from
``unicodedata.category`` (``L*`` and ``N*``), which is exact for the running Python's Unicode
database. Remaining differences from ``regex``: ``\\s`` follows ``str.isspace`` (it also matches
U+001C..U+001F, which are not Unicode ``White_Space``), and the Unicode version is that of
``unicodedata`` rather than of the ``regex`` package.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import unicodedata
from collections import OrderedDict
from collections.abc import Iterable

from megatron_npu.data.tokenizer_types import TOKENIZER_TYPES

try:  # megatron-core >= 0.14
    from megatron.core.tokenizers import MegatronTokenizerBase

    def _init_base(tokenizer: MegatronTokenizerBase, paths: list[str]) -> None:
        MegatronTokenizerBase.__init__(tokenizer, paths[0] if paths else "", {})

except ImportError:  # megatron-core 0.13: the dataset package's abstract tokenizer
    from megatron.core.datasets.megatron_tokenizer import (
        MegatronTokenizer as MegatronTokenizerBase,
    )

    def _init_base(tokenizer: MegatronTokenizerBase, paths: list[str]) -> None:
        # its __init__ only stores unique_identifiers/unique_description, which NpuTokenizer
        # provides as properties; calling it would try to overwrite them
        return None


__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "NpuTokenizer",
    "NullIdTokenizer",
    "TokenizerError",
    "build_tokenizer",
    "bytes_to_unicode",
    "gpt2_pretokenize",
    "gpt2_pretokenize_pattern",
    "null_tokenizer",
]


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed, or a token is not in the vocabulary."""


class NpuTokenizer(MegatronTokenizerBase):
    """Common base: the interface megatron-core's datasets expect of ``config.tokenizer``."""

    def __init__(self, *paths: str | None, **options: object) -> None:
        self._paths = [os.fspath(p) for p in paths if p is not None]
        self._options = options
        _init_base(self, self._paths)

    # -- identity -------------------------------------------------------------------------------
    @property
    def unique_identifiers(self) -> OrderedDict:
        """Stable description used by megatron-core in its dataset cache hashes."""
        ids: OrderedDict = OrderedDict()
        ids["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ids["tokenizer_path"] = list(self._paths)
        for key in sorted(self._options):
            ids[key] = str(self._options[key])
        return ids

    @property
    def unique_description(self) -> str:
        return json.dumps(self.unique_identifiers, indent=4)

    # -- abstract interface -----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def vocab(self) -> dict[str, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def eod(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    # -- optional special tokens (Megatron's legacy tokenizer convention) ------------------------
    def _absent(self, what: str):
        raise NotImplementedError(f"{type(self).__name__} has no {what} token")

    @property
    def pad(self) -> int:
        return self._absent("pad")

    @property
    def cls(self) -> int:
        return self._absent("cls")

    @property
    def sep(self) -> int:
        return self._absent("sep")

    @property
    def mask(self) -> int:
        return self._absent("mask")

    @property
    def bos(self) -> int:
        return self._absent("bos")

    @property
    def eos(self) -> int:
        return self._absent("eos")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


# ------------------------------------------------------------------------------------------------
# Byte level
# ------------------------------------------------------------------------------------------------


class ByteLevelTokenizer(NpuTokenizer):
    """UTF-8 bytes as ids 0..255 plus an end-of-document id 256. ``vocab_size`` is 257."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__()

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode the bytes; the EOD id becomes nothing, invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if int(i) != self.EOD)
        return data.decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        vocab = {f"<0x{b:02X}>": b for b in range(256)}
        vocab["<eod>"] = self.EOD
        return vocab

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return self.EOD


class NullIdTokenizer(NpuTokenizer):
    """Megatron's NullTokenizer for megatron-core releases that lack
    ``megatron.core.tokenizers`` (0.13, 0.14): ids are the integers themselves, the end-of-document
    id is ``vocab_size_without_eod`` and ``vocab_size`` counts it."""

    def __init__(self, vocab_size_without_eod: int) -> None:
        super().__init__(vocab_size=int(vocab_size_without_eod))
        self._eod = int(vocab_size_without_eod)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._eod + 1)}

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def eod(self) -> int:
        return self._eod


def null_tokenizer(vocab_size: int):
    """The NullTokenizer Megatron-LM builds for ``--tokenizer-type NullTokenizer --vocab-size
    vocab_size`` (what ``--mock-data`` reads) on the installed release: megatron-core's own, given
    the option's value as Megatron-LM gives it, so the vocabulary is Megatron's -- ``vocab_size``
    plus the EOD id up to megatron-core 0.17, ``vocab_size`` with the EOD id inside from 0.18 --
    or :class:`NullIdTokenizer` (``vocab_size`` plus EOD, as Megatron-LM's own) where the release
    has none."""
    try:
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    except ImportError:
        return NullIdTokenizer(vocab_size)
    return NullTokenizer(vocab_size)


def null_vocab_size_for(tokens: int) -> int:
    """The ``--vocab-size`` whose :func:`null_tokenizer` has ``tokens`` ids (EOD included) on
    the installed release: ``tokens - 1`` up to megatron-core 0.17, ``tokens`` from 0.18."""
    return tokens - (int(null_tokenizer(tokens).vocab_size) - tokens)


# ------------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _escape_range(lo: int, hi: int) -> str:
    def esc(cp: int) -> str:
        return f"\\U{cp:08x}"

    return esc(lo) if lo == hi else f"{esc(lo)}-{esc(hi)}"


@functools.cache
def _category_class(prefix: str) -> str:
    """The code points whose Unicode general category starts with ``prefix``, as a regex set body
    (what ``\\p{L}`` / ``\\p{N}`` mean in the ``regex`` package)."""
    ranges: list[str] = []
    start = None
    category = unicodedata.category
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and category(chr(cp)).startswith(prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append(_escape_range(start, cp - 1))
            start = None
    return "".join(ranges)


@functools.lru_cache(maxsize=1)
def gpt2_pretokenize_pattern() -> re.Pattern[str]:
    """GPT-2's pre-tokenization regex, compiled with the standard ``re`` module::

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    """
    letters = _category_class("L")
    numbers = _category_class("N")
    return re.compile(
        rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^\s{letters}{numbers}]+"""
        r"""|\s+(?!\S)|\s+"""
    )


def gpt2_pretokenize(text: str) -> list[str]:
    """Split ``text`` into GPT-2 pre-tokens (words with their leading space, numbers, ...)."""
    return gpt2_pretokenize_pattern().findall(text)


class GPT2BPETokenizer(NpuTokenizer):
    """GPT-2 byte-level BPE (``vocab.json`` + ``merges.txt``); EOD is ``<|endoftext|>``."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> None:
        super().__init__(vocab_file, merge_file)
        self.vocab_file = os.fspath(vocab_file)
        self.merge_file = os.fspath(merge_file)
        self.encoder = _load_json_vocab(self.vocab_file)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks = _load_merges(self.merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        if self.EOD_TOKEN not in self.encoder:
            raise TokenizerError(f"{self.vocab_file}: no {self.EOD_TOKEN!r} entry")
        self._eod = self.encoder[self.EOD_TOKEN]
        self._cache: dict[str, list[str]] = {}

    def bpe(self, token: str) -> list[str]:
        """Apply the merges to one pre-token (already mapped through :func:`bytes_to_unicode`)."""
        cached = self._cache.get(token)
        if cached is not None:
            return cached
        word = tuple(token)
        if len(word) < 2:
            result = list(word)
        else:
            ranks = self.bpe_ranks
            while len(word) > 1:
                pairs = set(zip(word[:-1], word[1:], strict=True))
                bigram = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
                if bigram not in ranks:
                    break
                first, second = bigram
                merged: list[str] = []
                i = 0
                while i < len(word):
                    if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                        merged.append(first + second)
                        i += 2
                    else:
                        merged.append(word[i])
                        i += 1
                word = tuple(merged)
            result = list(word)
        if len(self._cache) < 100_000:
            self._cache[token] = result
        return result

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        encoder = self.encoder
        for piece in gpt2_pretokenize(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for sub in self.bpe(mapped):
                try:
                    ids.append(encoder[sub])
                except KeyError:
                    raise TokenizerError(
                        f"{self.vocab_file}: BPE token {sub!r} is not in the vocabulary"
                    ) from None
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        return self.encoder

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self.decoder

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        raise TokenizerError(f"{path}: {what} not found") from None
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path}: {what} is not UTF-8 ({exc})") from None


def _load_json_vocab(path: str) -> dict[str, int]:
    try:
        vocab = json.loads(_read_text(path, "vocab file"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(
            f"{path}:{exc.lineno}: vocab file is not valid JSON: {exc.msg}"
        ) from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"{path}: vocab file must be a JSON object of token -> integer id")
    return vocab


def _load_merges(path: str) -> dict[tuple[str, str], int]:
    ranks: dict[tuple[str, str], int] = {}
    for lineno, line in enumerate(_read_text(path, "merges file").split("\n"), start=1):
        if lineno == 1 and line.startswith("#version"):
            continue
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}:{lineno}: expected two symbols per merge, got {line!r}")
        ranks.setdefault((parts[0], parts[1]), len(ranks))
    return ranks


# ------------------------------------------------------------------------------------------------
# BERT WordPiece
# ------------------------------------------------------------------------------------------------


def _is_whitespace(ch: str) -> bool:
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # All non-letter/number ASCII is punctuation for BERT (e.g. "^", "$", "`").
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def bert_basic_tokenize(text: str, lower_case: bool = True) -> list[str]:
    """BERT's BasicTokenizer: clean, split CJK characters, (lower-case + strip accents), split on
    whitespace and punctuation."""
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            cleaned.append(" ")
        elif _is_cjk(cp):
            cleaned.append(f" {ch} ")
        else:
            cleaned.append(ch)
    tokens: list[str] = []
    for word in "".join(cleaned).split():
        if lower_case:
            word = word.lower()
            word = "".join(
                c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn"
            )
        current: list[str] = []
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    tokens.append("".join(current))
                    current = []
                tokens.append(ch)
            else:
                current.append(ch)
        if current:
            tokens.append("".join(current))
    return tokens


class BertWordPieceTokenizer(NpuTokenizer):
    """BERT WordPiece from a one-token-per-line ``vocab.txt``. EOD is ``[SEP]``, pad ``[PAD]``.

    Unlike Megatron-LM's legacy ``_BertWordPieceTokenizer`` this does not append ``[BOS]``/``[EOS]``
    to the vocabulary, so ``vocab_size`` is the number of lines in the vocab file.
    """

    UNK = "[UNK]"
    MAX_INPUT_CHARS_PER_WORD = 100

    def __init__(self, vocab_file: str | os.PathLike, lower_case: bool = True) -> None:
        super().__init__(vocab_file, lower_case=lower_case)
        self.vocab_file = os.fspath(vocab_file)
        self.lower_case = lower_case
        self._vocab: dict[str, int] = {}
        for line in _read_text(self.vocab_file, "vocab file").split("\n"):
            token = line.rstrip("\r").strip()
            if token and token not in self._vocab:
                self._vocab[token] = len(self._vocab)
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        missing = [t for t in ("[UNK]", "[SEP]", "[PAD]") if t not in self._vocab]
        if missing:
            raise TokenizerError(f"{self.vocab_file}: vocab file lacks {', '.join(missing)}")
        self.unk_id = self._vocab[self.UNK]

    def wordpiece(self, word: str) -> list[str]:
        """Greedy longest-match-first split of one basic token into ``##``-continued pieces."""
        if len(word) > self.MAX_INPUT_CHARS_PER_WORD:
            return [self.UNK]
        pieces: list[str] = []
        start = 0
        while start < len(word):
            end = len(word)
            piece = None
            while start < end:
                candidate = word[start:end]
                if start > 0:
                    candidate = "##" + candidate
                if candidate in self._vocab:
                    piece = candidate
                    break
                end -= 1
            if piece is None:
                return [self.UNK]
            pieces.append(piece)
            start = end
        return pieces

    def text_to_tokens(self, text: str) -> list[str]:
        return [p for w in bert_basic_tokenize(text, self.lower_case) for p in self.wordpiece(w)]

    def tokenize(self, text: str) -> list[int]:
        return [self._vocab[t] for t in self.text_to_tokens(text)]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Megatron's decode: join with spaces, glue ``##`` pieces back on."""
        tokens = [self._inv_vocab[int(i)] for i in ids]
        return " ".join(tokens).replace(" ##", "").strip()

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def sep(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def cls(self) -> int:
        if "[CLS]" not in self._vocab:
            return self._absent("cls")
        return self._vocab["[CLS]"]

    @property
    def mask(self) -> int:
        if "[MASK]" not in self._vocab:
            return self._absent("mask")
        return self._vocab["[MASK]"]


# ------------------------------------------------------------------------------------------------


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
) -> NpuTokenizer:
    """Build a tokenizer by Megatron ``--tokenizer-type`` name (see :data:`TOKENIZER_TYPES`)."""
    if tokenizer_type == "ByteLevel":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise TokenizerError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        if vocab_file is None:
            raise TokenizerError(f"{tokenizer_type} needs --vocab-file")
        return BertWordPieceTokenizer(vocab_file, lower_case=tokenizer_type.endswith("LowerCase"))
    raise TokenizerError(
        f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
