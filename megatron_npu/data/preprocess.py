"""Tokenize raw text into Megatron's indexed dataset format (``.bin`` + ``.idx``).

This is the equivalent of Megatron-LM's ``tools/preprocess_data.py`` for the GPT pipeline:

* Inputs whose name ends in ``.json`` or ``.jsonl`` are JSON Lines (e.g. WikiExtractor ``--json``
  output): one JSON object per line, text under ``json_key`` (default ``"text"``); blank lines
  are ignored. Any other file is plain text, **one document per blank-line-separated paragraph**
  (a paragraph's inner line breaks are kept). A gzip-compressed input (``corpus.jsonl.gz``)
  reads as its content, the ``.gz`` set aside when telling JSON Lines by the name.
* Every record becomes one document holding a single sequence, with the EOD token appended when
  ``append_eod`` (as Megatron does, an empty record gets no EOD and becomes an empty document).
* Output prefix per key: ``{output_prefix}_{key}_document`` (Megatron's naming), written with
  megatron-core's own ``IndexedDatasetBuilder``; the token dtype is
  ``DType.optimal_dtype(tokenizer.vocab_size)`` (uint16 below 65500 ids, else int32), like Megatron.
* Files are written under temporary names and renamed into place only once complete, then given
  mode 0640; directories this function creates get mode 0750.
* Bad input raises :class:`PreprocessError` naming the file (and line, for JSONL).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy

from megatron_npu import console
from megatron_npu.data.tokenizer_types import TOKENIZER_TYPES
from megatron_npu.files import FILE_MODE, GZIP_ERRORS, make_dir, open_input

__all__ = [
    "PreprocessError",
    "add_preprocess_args",
    "dataset_prefix",
    "preprocess",
    "run_preprocess",
]

JSONL_SUFFIXES = (".json", ".jsonl")


class PreprocessError(ValueError):
    """Unusable input: missing file, malformed JSON line, missing or non-string key."""


def dataset_prefix(output_prefix: str | os.PathLike, key: str) -> str:
    """The indexed-dataset prefix :func:`preprocess` writes for ``key``."""
    return f"{os.fspath(output_prefix)}_{key}_document"


def _is_jsonl(path: str) -> bool:
    return path.lower().removesuffix(".gz").endswith(JSONL_SUFFIXES)


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, decoded line) pairs; decoding per line so errors name the exact line. A
    gzip-compressed file (``corpus.jsonl.gz``, told by its first bytes) reads as its content."""
    try:
        handle, compressed = open_input(path)
    except FileNotFoundError:
        raise PreprocessError(f"{path}: input file not found") from None
    except IsADirectoryError:
        raise PreprocessError(f"{path}: input is a directory, not a file") from None
    except PermissionError:
        raise PreprocessError(f"{path}: input file is not readable") from None
    with handle:
        lineno = 0
        try:
            for lineno, raw in enumerate(handle, start=1):
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PreprocessError(
                        f"{path}:{lineno}: not valid UTF-8 ({exc.reason})"
                    ) from None
        except GZIP_ERRORS as exc:
            if not compressed:
                raise
            raise PreprocessError(f"{path}:{lineno + 1}: a damaged gzip file ({exc})") from None


def _jsonl_records(path: str, keys: Sequence[str]) -> Iterator[dict[str, str]]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PreprocessError(f"{path}:{lineno}: malformed JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise PreprocessError(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
            )
        out = {}
        for key in keys:
            if key not in record:
                raise PreprocessError(f"{path}:{lineno}: missing key {key!r}")
            value = record[key]
            if not isinstance(value, str):
                raise PreprocessError(
                    f"{path}:{lineno}: key {key!r} must be a string, got {type(value).__name__}"
                )
            out[key] = value
        yield out


def _text_records(path: str, keys: Sequence[str]) -> Iterator[dict[str, str]]:
    if len(keys) != 1:
        raise PreprocessError(f"{path}: plain-text input supports exactly one key, got {keys}")
    key = keys[0]
    paragraph: list[str] = []
    for _lineno, line in _lines(path):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield {key: "".join(paragraph).rstrip("\r\n")}
            paragraph = []
    if paragraph:
        yield {key: "".join(paragraph).rstrip("\r\n")}


def _records(paths: Sequence[str], keys: Sequence[str]) -> Iterator[dict[str, str]]:
    for path in paths:
        yield from (_jsonl_records if _is_jsonl(path) else _text_records)(path, keys)


class _Encoder:
    """Picklable per-record tokenization (run in worker processes when ``workers > 1``)."""

    def __init__(self, tokenizer: Any, keys: Sequence[str], append_eod: bool) -> None:
        self.tokenizer = tokenizer
        self.keys = list(keys)
        self.append_eod = append_eod

    def __call__(self, record: dict[str, str]) -> tuple[dict[str, list[int]], int]:
        out = {}
        nbytes = 0
        for key in self.keys:
            text = record[key]
            nbytes += len(text)
            ids = list(self.tokenizer.tokenize(text)) if text else []
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            out[key] = ids
        return out, nbytes


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: Any,
    *,
    json_key: str | Sequence[str] = "text",
    append_eod: bool = True,
    workers: int = 1,
) -> dict[str, Any]:
    """Tokenize ``inputs`` and write one indexed dataset per key.

    Args:
        inputs: JSONL (``.json``/``.jsonl``) or plain-text files, processed in the given order.
        output_prefix: output path prefix; files are ``{output_prefix}_{key}_document.{bin,idx}``.
        tokenizer: anything with ``tokenize(text) -> list[int]``, ``eod`` and ``vocab_size``
            (see :mod:`megatron_npu.data.tokenizers`).
        json_key: the JSON key (or keys) holding the text.
        append_eod: append ``tokenizer.eod`` to every non-empty document.
        workers: tokenizer processes (1 = in this process).

    Returns:
        A summary: ``prefix`` (of the first key), ``prefixes`` (key -> prefix), ``documents``
        (records read), ``empty_documents`` and ``tokens`` (key -> count), ``dtype``,
        ``vocab_size``, ``files``, ``inputs``, ``input_chars`` and ``seconds``.

    Raises:
        PreprocessError: for missing/unreadable inputs and malformed records; nothing is left at
            the output paths in that case.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    started = time.perf_counter()
    keys = [json_key] if isinstance(json_key, str) else list(json_key)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(f"json_key must name one or more distinct keys, got {json_key!r}")
    paths = [os.fspath(p) for p in inputs]
    if not paths:
        raise PreprocessError("no input files given")
    for path in paths:
        if not os.path.isfile(path):
            reason = "is not a regular file" if os.path.exists(path) else "input file not found"
            raise PreprocessError(f"{path}: {reason}")
    if workers < 1:
        raise PreprocessError(f"workers must be >= 1, got {workers}")

    output_prefix = os.fspath(output_prefix)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    make_dir(out_dir)

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: dataset_prefix(output_prefix, key) for key in keys}
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temp_files = {key: (prefixes[key] + ".bin" + tag, prefixes[key] + ".idx" + tag) for key in keys}
    builders = {}
    tokens = dict.fromkeys(keys, 0)
    empty_documents = dict.fromkeys(keys, 0)
    documents = 0
    input_chars = 0
    encoder = _Encoder(tokenizer, keys, append_eod)
    pool = None
    try:
        for key in keys:
            builders[key] = IndexedDatasetBuilder(temp_files[key][0], dtype=dtype)
        records = _records(paths, keys)
        if workers > 1:
            # Build lazily-initialised tables in the parent so forked workers inherit them.
            encoder({key: "warm up" for key in keys})
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else None)
            pool = context.Pool(workers)
            encoded = pool.imap(encoder, records, chunksize=32)
        else:
            encoded = map(encoder, records)
        for doc, nbytes in encoded:
            documents += 1
            input_chars += nbytes
            for key, ids in doc.items():
                if ids:
                    builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                else:
                    builders[key].add_document(numpy.asarray([], dtype=dtype), [])
                    empty_documents[key] += 1
                tokens[key] += len(ids)
        for key in keys:
            builders[key].finalize(temp_files[key][1])
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for files in temp_files.values():
            for path in files:
                if os.path.exists(path):
                    os.unlink(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    written = []
    for key in keys:
        for temp, final in zip(
            temp_files[key], (prefixes[key] + ".bin", prefixes[key] + ".idx"), strict=True
        ):
            os.chmod(temp, FILE_MODE)
            os.replace(temp, final)
            written.append(final)

    return {
        "prefix": prefixes[keys[0]],
        "prefixes": prefixes,
        "documents": documents,
        "empty_documents": empty_documents,
        "tokens": tokens,
        "dtype": numpy.dtype(dtype).name,
        "vocab_size": tokenizer.vocab_size,
        "files": written,
        "inputs": paths,
        "input_chars": input_chars,
        "seconds": round(time.perf_counter() - started, 3),
    }


def add_preprocess_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``megatron-npu preprocess`` options to ``parser`` (returns it)."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="JSONL (.json/.jsonl, one object per line) or plain-text files "
        "(one document per blank-line-separated paragraph), each possibly gzip-compressed",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="output prefix; writes PREFIX_<key>_document.bin/.idx",
    )
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", default=None, help="vocab.json (GPT-2) or vocab.txt (BERT)")
    parser.add_argument("--merge-file", default=None, help="merges.txt (GPT-2 BPE)")
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys holding the text"
    )
    parser.add_argument(
        "--no-append-eod",
        dest="append_eod",
        action="store_false",
        help="do not append the end-of-document token",
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return parser


def run_preprocess(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`preprocess` from parsed :func:`add_preprocess_args` options.

    Tokenizer problems are re-raised as :class:`PreprocessError` so a CLI can catch one type.
    The tokenizers subclass megatron-core's, imported here so that the CLI's parsers do not.
    """
    from megatron_npu.data.tokenizers import TokenizerError, build_tokenizer

    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    except TokenizerError as exc:
        raise PreprocessError(str(exc)) from None
    summary = preprocess(
        args.input,
        args.output_prefix,
        tokenizer,
        json_key=list(args.json_keys),
        append_eod=getattr(args, "append_eod", True),
        workers=args.workers,
    )
    for warning in empty_output_warnings(summary):
        console.warn(f"megatron-npu preprocess: warning: {warning}")
    return summary


def empty_output_warnings(summary: dict[str, Any]) -> list[str]:
    """What to warn about in a :func:`preprocess` summary: a key that got no token at all
    (0 documents, or only empty ones) makes a dataset ``megatron-npu train`` refuses."""
    out = []
    for key, prefix in summary["prefixes"].items():
        if summary["tokens"][key] == 0:
            out.append(
                f"{prefix}.{{bin,idx}} holds {summary['documents']} documents and 0 tokens "
                f"(no text under the JSON key {key!r} in {', '.join(summary['inputs'])}); "
                "megatron-npu train refuses an empty dataset"
            )
    return out
