"""Check an indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``) before anything reads it.

Megatron-Core's ``_IndexReader`` asserts on a bad header and otherwise maps whatever the files
hold: a truncated ``.bin`` or an ``.idx`` whose counts disagree fails much later, in a worker, as
an index error or garbage tokens. :func:`check_indexed_dataset` reads the same format
(``megatron.core.datasets.indexed_dataset``, version 1) and raises
:class:`~megatron_npu.data.errors.TrainingInputError` naming the file and the field:

    magic "MMIDIDX\\0\\0" | version <Q == 1 | dtype code <B | sequence count <Q |
    document count <Q | int32 sizes[sequence count] | int64 pointers[sequence count] |
    int64 document indices[document count]

Numpy only (no megatron import), so the launcher runs it before starting any rank.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from megatron_npu.data.errors import TrainingInputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
#: Megatron's ``DType`` codes -> item size in bytes (uint8, int8, int16, int32, int64, float64,
#: float32, uint16).
ITEM_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
#: The same codes as numpy dtypes (the ``.bin`` is read with them).
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
#: :func:`check_token_ids` scans a ``.bin`` up to this size; a larger one is checked batch by
#: batch as the run reads it (``training.data``).
SCAN_LIMIT_BYTES = 256 << 20

_REMEDY = "rebuild it with `megatron-npu preprocess` (or Megatron's preprocess_data.py)"


def _bad(path: str, what: str) -> TrainingInputError:
    return TrainingInputError(f"indexed dataset file {path}: {what}", _REMEDY)


def check_indexed_dataset(prefix: str, *, flag: str = "--data-path") -> None:
    """Raise a named error unless ``prefix.idx`` and ``prefix.bin`` form a readable dataset."""
    idx, binary = f"{prefix}.idx", f"{prefix}.bin"
    missing = [p for p in (idx, binary) if not os.path.isfile(p)]
    if missing:
        raise TrainingInputError(
            f"{flag} {prefix}: no {' and no '.join(missing)}",
            "give the prefix of a preprocessed dataset (PREFIX.bin + PREFIX.idx, without the "
            "suffix)",
        )
    size = os.path.getsize(idx)
    with open(idx, "rb") as stream:
        head = stream.read(HEADER_BYTES)
        if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            raise _bad(idx, f"bad magic {head[:9]!r}, expected {MAGIC!r} (not a Megatron index)")
        if len(head) < HEADER_BYTES:
            raise _bad(idx, f"truncated header: {size} bytes, the header alone is {HEADER_BYTES}")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise _bad(idx, f"unsupported version {version} (Megatron-Core reads version 1)")
        if code not in ITEM_BYTES:
            raise _bad(idx, f"unknown dtype code {code} (known: {sorted(ITEM_BYTES)})")
        expected = HEADER_BYTES + sequences * (4 + 8) + documents * 8
        if size < expected:
            raise _bad(
                idx,
                f"truncated: {size} bytes, but {sequences} sequences and {documents} document "
                f"indices need {expected}",
            )
        sizes = np.frombuffer(stream.read(4 * sequences), dtype=np.int32)
        pointers = np.frombuffer(stream.read(8 * sequences), dtype=np.int64)
        doc_index = np.frombuffer(stream.read(8 * documents), dtype=np.int64)
    item = ITEM_BYTES[code]
    if sequences and (sizes < 0).any():
        raise _bad(idx, "negative sequence length")
    starts = np.zeros(sequences, dtype=np.int64)
    if sequences:
        np.cumsum(sizes[:-1].astype(np.int64) * item, out=starts[1:])
    if not np.array_equal(pointers, starts):
        raise _bad(idx, "sequence pointers disagree with the sequence lengths")
    if (
        documents < 1
        or doc_index[0] != 0
        or doc_index[-1] != sequences
        or (np.diff(doc_index) < 0).any()
    ):
        raise _bad(
            idx,
            f"document indices are inconsistent with the sequence count {sequences} "
            "(must rise from 0 to the sequence count)",
        )
    needed = int(sizes.astype(np.int64).sum()) * item
    if needed == 0:
        raise TrainingInputError(
            f"{flag} {prefix}: the dataset is empty ({sequences} sequences, 0 tokens): nothing "
            "to train on",
            "preprocess an input that holds text (megatron-npu preprocess reports its document "
            "and token counts)",
        )
    have = os.path.getsize(binary)
    if have < needed:
        raise TrainingInputError(
            f"indexed dataset file {binary}: truncated: {have} bytes, "
            f"its index {idx} needs {needed}",
            _REMEDY,
        )


def token_dtype(prefix: str) -> np.dtype:
    """The token dtype ``prefix.idx`` records (the file passed :func:`check_indexed_dataset`)."""
    with open(f"{prefix}.idx", "rb") as stream:
        stream.seek(len(MAGIC) + 8)
        return np.dtype(DTYPES[stream.read(1)[0]])


def out_of_vocab_message(flag: str, where: str, token: int, vocab_size: int) -> str:
    """The one wording of an out-of-vocabulary token id (preflight and the batch check)."""
    return (
        f"{flag} {where}: token id {token} is outside the tokenizer's vocabulary "
        f"(ids 0..{vocab_size - 1})"
    )


OUT_OF_VOCAB_REMEDY = (
    "preprocess the data with the tokenizer this run uses (the same --tokenizer-type, "
    "--vocab-file and --merge-file)"
)


def check_token_ids(
    prefix: str, vocab_size: int, *, flag: str = "--data-path", scan_limit: int = SCAN_LIMIT_BYTES
) -> bool:
    """Refuse ``prefix`` when it holds a token id outside ``0..vocab_size - 1``.

    Cheap first: an unsigned dtype whose largest value is below ``vocab_size`` cannot hold one.
    Otherwise the ``.bin`` is scanned when it is at most ``scan_limit`` bytes. Returns whether
    the ids were proven in range (False: too large to scan here; the run checks each batch)."""
    dtype = token_dtype(prefix)
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return True
    binary = f"{prefix}.bin"
    if os.path.getsize(binary) > scan_limit:
        return False
    count = os.path.getsize(binary) // dtype.itemsize
    if count == 0:
        return True
    tokens = np.memmap(binary, dtype=dtype, mode="r", shape=(count,))
    low, high = tokens.min(), tokens.max()
    bad = high if high >= vocab_size else low if low < 0 else None
    if bad is not None:
        raise TrainingInputError(
            out_of_vocab_message(flag, prefix, int(bad), vocab_size), OUT_OF_VOCAB_REMEDY
        )
    return True
