"""Turning the report's INPUT paths into one :class:`ResultSet`, each kind told by its content.

A folder is a ``compare`` output (it holds ``results.json``), a parity results folder (it holds
parity records), or a parity ``--results`` parent (its newest ``run-*`` folder is read). A JSON
file is a pytest-benchmark file, a ``compare`` results file, ``megatron-npu info --json`` output
or a single parity record. Whatever cannot be used becomes a :class:`Skipped` entry that the page
shows; only a path that does not exist is an error (a typo, not a partial result).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_npu.reports import benchmarks, compare_results, locate_view, parity_records
from megatron_npu.reports.errors import ReportInputError, Skipped

from megatron_npu.formats import FormatError
from megatron_npu.formats.parity_record import ParityRecord

KINDS = ("parity", "compare", "benchmark", "info")


@dataclass(frozen=True)
class InfoSnapshot:
    """``megatron-npu info --json`` output."""

    source: str
    device: dict[str, Any]
    versions: dict[str, Any]
    patches: list[dict[str, Any]]


def looks_like_info(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("device"), dict)
        and isinstance(data.get("versions"), dict)
        and isinstance(data.get("patches"), list)
    )


@dataclass
class ResultSet:
    """Everything read from one set of inputs."""

    sources: list[str] = field(default_factory=list)
    parity: list[ParityRecord] = field(default_factory=list)
    comparisons: list[compare_results.Comparison] = field(default_factory=list)
    benchmark_files: list[benchmarks.BenchmarkFile] = field(default_factory=list)
    infos: list[InfoSnapshot] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    locates: list[locate_view.LocateResult] = field(default_factory=list)

    @property
    def benches(self) -> list[benchmarks.Bench]:
        return [b for f in self.benchmark_files for b in f.benches]

    def kinds(self) -> list[str]:
        present = {
            "parity": self.parity,
            "compare": self.comparisons,
            "benchmark": self.benchmark_files,
            "info": self.infos,
        }
        return [k for k in KINDS if present[k]]


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON (truncated or corrupt): {exc}") from None


def _add_json_file(path: Path, out: ResultSet) -> None:
    try:
        data = _load_json(path)
    except ValueError as exc:
        out.skipped.append(Skipped(str(path), str(exc)))
        return
    try:
        if benchmarks.looks_like_benchmark(data):
            out.benchmark_files.append(benchmarks.parse(data, str(path)))
        elif compare_results.looks_like_compare(data):
            out.comparisons.append(compare_results.parse(data, str(path)))
        elif looks_like_info(data):
            out.infos.append(
                InfoSnapshot(str(path), data["device"], data["versions"], data["patches"])
            )
        elif locate_view.looks_like_locate(data):
            out.locates.append(locate_view.parse(data, str(path)))
        elif parity_records.looks_like_record(data):
            out.parity.append(ParityRecord.parse(data, str(path)))
        else:
            out.skipped.append(
                Skipped(
                    str(path),
                    "not a parity record, compare results, pytest-benchmark JSON or info --json "
                    "output (none of their keys found)",
                )
            )
    except FormatError as exc:
        out.skipped.append(Skipped(str(path), exc.message))
    except (
        compare_results.BadCompareResults,
        benchmarks.BadBenchmarkFile,
        locate_view.BadLocateResult,
    ) as exc:
        out.skipped.append(Skipped(str(path), str(exc)))


def _parity_runs(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.glob("run-*") if p.is_dir() and parity_records.record_files(p)
    )


def _add_folder(directory: Path, out: ResultSet) -> None:
    located = [
        directory / name
        for name in (locate_view.LOCATE_FILE, locate_view.MSPROBE_FILE)
        if (directory / name).is_file()
    ]
    if located:
        for path in located:
            _add_json_file(path, out)
        return
    results = directory / compare_results.RESULTS_FILE
    if results.is_file():
        _add_json_file(results, out)
        return
    if parity_records.record_files(directory):
        cells, skipped = parity_records.read_folder(directory)
        out.parity.extend(cells)
        out.skipped.extend(skipped)
        return
    runs = _parity_runs(directory)
    if runs:
        newest = runs[-1]
        out.skipped.extend(
            Skipped(str(r), f"older parity run; the newest, {newest.name}, is shown")
            for r in runs[:-1]
        )
        _add_folder(newest, out)
        return
    out.skipped.append(
        Skipped(
            str(directory),
            f"empty: no parity records (*.json), no {compare_results.RESULTS_FILE} and no "
            "run-* parity folders",
        )
    )


def load(inputs: Sequence[str | Path]) -> ResultSet:
    """Read every input; raises :class:`ReportInputError` only for a path that does not exist."""
    if isinstance(inputs, str | Path):
        raise ReportInputError("inputs must be a list of paths, not a single path")
    out = ResultSet()
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise ReportInputError(f"input {str(path)!r} does not exist")
        out.sources.append(str(path))
        if path.is_dir():
            _add_folder(path, out)
        else:
            _add_json_file(path, out)
    out.parity, dupes = parity_records.duplicates(out.parity)
    out.skipped.extend(dupes)
    return out
