"""Check an indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``) before anything reads it.

Megatron-Core's ``_IndexReader`` asserts on a bad header and otherwise maps whatever the files
hold: a truncated ``.bin`` or an ``.idx`` whose counts disagree fails much later, in a worker, as
an index error or garbage tokens. :func:`check_indexed_dataset` reads the same format
(``megatron.core.datasets.indexed_dataset``, version 1) and raises
:class:`~megatron_npu.training.errors.TrainingInputError` naming the file and the field:

    magic "MMIDIDX\\0\\0" | version <Q == 1 | dtype code <B | sequence count <Q |
    document count <Q | int32 sizes[sequence count] | int64 pointers[sequence count] |
    int64 document indices[document count]

Numpy only (no megatron import), so the launcher runs it before starting any rank.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from megatron_npu.training.errors import TrainingInputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
#: Megatron's ``DType`` codes -> item size in bytes (uint8, int8, int16, int32, int64, float64,
#: float32, uint16).
ITEM_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}

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
    have = os.path.getsize(binary)
    if have < needed:
        raise TrainingInputError(
            f"indexed dataset file {binary}: truncated: {have} bytes, its index {idx} needs {needed}",
            _REMEDY,
        )
