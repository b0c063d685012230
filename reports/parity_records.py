"""Parity records (``docs/parity-results.md``, schema 1 and 2) read for a report.

The harness's own reader (:func:`megatron_npu.parity.results.read_records`) stops at the first bad
file; a report must instead show every good record and say which files it left out and why, so this
module validates each file on its own and turns a bad one into a :class:`Skipped` entry naming
the file and the key. Schema 2 adds ``kernels``, ``npu_kernel_exercised``, ``benchmark`` and
records of crashed or hung cells (verdict rule ``crash`` / ``timeout``, tensors possibly empty).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_npu.parity.results import PARALLEL_KEYS
from megatron_npu.parity.verdict import STATUSES
from megatron_npu.reports.errors import Skipped

#: Parity record schema versions this reader understands (docs/parity-results.md:
#: readers accept 1 and 2).
PARITY_SCHEMAS = (1, 2, 3)
#: Verdict rules of a cell that produced no comparison (schema 2).
FAILURE_RULES = ("crash", "timeout")


class BadRecord(ValueError):
    """A parity record that cannot be shown; the message names the key."""


@dataclass(frozen=True)
class ParityCell:
    """One parity record: a (patch, case, dtype, parallel sizes, device) cell and its verdict."""

    patch_id: str
    target: str
    case: str
    dtype: str
    parallel: dict[str, int]
    device: str
    status: str
    rule: str
    reason: str
    override: bool
    tensors: dict[str, dict[str, Any]]
    tolerance: dict[str, Any] | None
    provenance: dict[str, Any]
    schema_version: int
    source: str
    kernels: dict[str, int] | None = None
    npu_kernel_exercised: bool | None = None
    benchmark: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def parallel_label(self) -> str:
        return "-".join(f"{k}{self.parallel[k]}" for k in PARALLEL_KEYS)

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.patch_id, self.case, self.dtype, self.parallel_label, self.device)

    @property
    def label(self) -> str:
        return f"{self.patch_id} [{self.case}, {self.dtype}, {self.parallel_label}, {self.device}]"


def _need(data: Any, path: str, types: type | tuple[type, ...]) -> Any:
    value: Any = data
    where = ""
    for part in path.split("."):
        if not isinstance(value, dict):
            raise BadRecord(f"{where or 'record'} is not a JSON object")
        if part not in value:
            raise BadRecord(f"missing key {path!r}")
        value = value[part]
        where = f"{where}.{part}" if where else part
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        raise BadRecord(
            f"bad key {path!r}: {value!r} is not {'/'.join(t.__name__ for t in allowed)}"
        )
    return value


def parse_cell(data: Any, source: str) -> ParityCell:
    """Validate one record (schema 1 or 2); :class:`BadRecord` names the bad key."""
    version = _need(data, "schema_version", int)
    if version not in PARITY_SCHEMAS:
        raise BadRecord(
            f"schema_version {version} is not supported (this report reads {PARITY_SCHEMAS})"
        )
    if version < 3:  # schema 3 added the context-parallel size; older records had CP 1
        data = {**data, "parallel": {"cp": 1, **_need(data, "parallel", dict)}}
    parallel = {k: _need(data, f"parallel.{k}", int) for k in PARALLEL_KEYS}
    status = _need(data, "verdict.status", str)
    if status not in STATUSES:
        raise BadRecord(f"bad key 'verdict.status': {status!r} is not one of {STATUSES}")
    rule = _need(data, "verdict.rule", str)
    tensors = _need(data, "tensors", dict)
    if not tensors and rule not in FAILURE_RULES:
        raise BadRecord("key 'tensors' is empty in a record that is not a crash or timeout")
    for name, entry in tensors.items():  # tensor names may hold dots: no dotted lookup
        if not isinstance(entry, dict) or not isinstance(entry.get("metrics"), dict):
            raise BadRecord(f"missing or bad key 'tensors[{name!r}].metrics'")
        if not isinstance(entry.get("verdict"), dict) or "status" not in entry["verdict"]:
            raise BadRecord(f"missing or bad key 'tensors[{name!r}].verdict.status'")
    known = {
        "schema_version",
        "patch_id",
        "target",
        "case",
        "dtype",
        "parallel",
        "device",
        "tensors",
        "verdict",
        "tolerance",
        "provenance",
        "kernels",
        "npu_kernel_exercised",
        "benchmark",
    }
    return ParityCell(
        patch_id=_need(data, "patch_id", str),
        target=_need(data, "target", str),
        case=_need(data, "case", str),
        dtype=_need(data, "dtype", str),
        parallel=parallel,
        device=_need(data, "device", str),
        status=status,
        rule=rule,
        reason=_need(data, "verdict.reason", str),
        override=bool(data["verdict"].get("override", False)),
        tensors=tensors,
        tolerance=_need(data, "tolerance", (dict, type(None))),
        provenance=_need(data, "provenance", dict),
        schema_version=version,
        source=source,
        kernels=_need(data, "kernels", dict) if version >= 2 else None,
        npu_kernel_exercised=_need(data, "npu_kernel_exercised", bool) if version >= 2 else None,
        benchmark=_need(data, "benchmark", (dict, type(None))) if version >= 2 else None,
        extra={k: v for k, v in data.items() if k not in known},
    )


def looks_like_record(data: Any) -> bool:
    return isinstance(data, dict) and "patch_id" in data and "schema_version" in data


def read_file(path: Path) -> ParityCell:
    """One record file; :class:`BadRecord` says why it cannot be used."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise BadRecord(f"unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadRecord(f"not valid JSON (truncated or corrupt): {exc}") from None
    return parse_cell(data, str(path))


def record_files(directory: Path) -> list[Path]:
    """The record files of a results folder, as the harness writes them (hidden temp files out)."""
    return sorted(p for p in directory.glob("*.json") if not p.name.startswith("."))


def read_folder(directory: Path) -> tuple[list[ParityCell], list[Skipped]]:
    """Every readable record of ``directory``, and one :class:`Skipped` per file that is not."""
    cells: list[ParityCell] = []
    skipped: list[Skipped] = []
    for path in record_files(directory):
        try:
            cells.append(read_file(path))
        except BadRecord as exc:
            skipped.append(Skipped(str(path), str(exc)))
    return cells, skipped


def duplicates(cells: Iterable[ParityCell]) -> tuple[list[ParityCell], list[Skipped]]:
    """Keep the first record of each cell key; later ones with the same key are skipped."""
    seen: dict[tuple[str, ...], ParityCell] = {}
    skipped = []
    for cell in cells:
        if cell.key in seen:
            skipped.append(
                Skipped(cell.source, f"same cell as {seen[cell.key].source}; the first is shown")
            )
            continue
        seen[cell.key] = cell
    return list(seen.values()), skipped
