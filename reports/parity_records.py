"""Parity records (:class:`megatron_npu.formats.parity_record.ParityRecord`) read for a report.

The harness's own reader (:func:`megatron_npu.parity.results.read_records`) stops at the first bad
file; a report must instead show every good record and say which files it left out and why, so
each file is read on its own and a bad one becomes a :class:`Skipped` entry naming the file and
the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_npu.parity.results import record_files
from megatron_npu.reports.errors import Skipped

from megatron_npu.formats import FormatError
from megatron_npu.formats.parity_record import ParityRecord

__all__ = ["duplicates", "looks_like_record", "read_folder", "record_files"]


def looks_like_record(data: Any) -> bool:
    return isinstance(data, dict) and "patch_id" in data and "schema_version" in data


def read_folder(directory: Path) -> tuple[list[ParityRecord], list[Skipped]]:
    """Every readable record of ``directory``, and one :class:`Skipped` per file that is not."""
    cells: list[ParityRecord] = []
    skipped: list[Skipped] = []
    for path in record_files(directory):
        try:
            cells.append(ParityRecord.read(path))
        except FormatError as exc:
            skipped.append(Skipped(exc.source, exc.message))
    return cells, skipped


def duplicates(cells: Iterable[ParityRecord]) -> tuple[list[ParityRecord], list[Skipped]]:
    """Keep the first record of each cell key; later ones with the same key are skipped."""
    seen: dict[tuple[str, ...], ParityRecord] = {}
    skipped = []
    for cell in cells:
        if cell.key in seen:
            skipped.append(
                Skipped(cell.source, f"same cell as {seen[cell.key].source}; the first is shown")
            )
            continue
        seen[cell.key] = cell
    return list(seen.values()), skipped
