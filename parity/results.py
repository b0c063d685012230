"""Structured parity results: one JSON record per (patch, case, dtype, parallel sizes, device).

The record is :class:`megatron_npu.formats.parity_record.ParityRecord` (its JSON Schema is
``docs/schemas/parity-record.schema.json``, what it means ``docs/parity-results.md``). This module
builds one from a cell's comparisons (:func:`build_record`) or failure (:func:`failed_record`),
names and writes its file, and reads a results folder back. Records are written atomically (temp
file in the same directory, fsync, ``os.replace``), so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_npu.parity.benchmark import BENCHMARK_PATH, BenchmarkResult
from megatron_npu.parity.metrics import TensorComparison
from megatron_npu.parity.verdict import Tolerance, Verdict, final_verdict

from megatron_npu.formats.parity_record import (
    DEVICES,
    PARALLEL_KEYS,
    SCHEMA_VERSION,
    ParityRecord,
    Provenance,
)

__all__ = [
    "DEVICES",
    "PARALLEL_KEYS",
    "SCHEMA_VERSION",
    "ParityRecord",
    "build_record",
    "failed_record",
    "read_records",
    "record_filename",
    "write_record",
]


# --------------------------------------------------------------------------- building


def build_record(
    *,
    patch_id: str,
    target: str,
    case: str,
    dtype: str,
    parallel: Mapping[str, int],
    comparisons: Mapping[str, TensorComparison],
    provenance: Provenance,
    tolerance: Tolerance | None = None,
    benchmarks: Mapping[str, BenchmarkResult | None] | None = None,
    benchmark_level: str = "L0",
    benchmark_unavailable: str | None = None,
    kernels: Mapping[str, int] | None = None,
) -> ParityRecord:
    """A record whose tensor and overall verdicts are computed from ``comparisons`` and, for
    16-bit cells, the stage-2 ``benchmarks`` (tensor name -> result or None). ValueError
    (:class:`megatron_npu.formats.FormatError`) names the field when the record breaks a rule
    of the format."""
    benchmarks = dict(benchmarks or {})
    tensors = {
        name: (comp, final_verdict(comp, tolerance, benchmarks.get(name)))
        for name, comp in comparisons.items()
    }
    judged = {n: b for n, b in benchmarks.items() if b is not None}
    section = None
    if judged or benchmark_unavailable:
        section = {
            "path": BENCHMARK_PATH,
            "level": benchmark_level,
            "unavailable": benchmark_unavailable,
            "tensors": {n: b.to_dict() for n, b in judged.items()},
        }
    kernels = {k: int(v) for k, v in (kernels or {}).items()}
    return _record(
        kernels=kernels,
        npu_kernel_exercised=any(v > 0 for v in kernels.values()),
        benchmark=section,
        patch_id=patch_id,
        target=target,
        case=case,
        dtype=dtype,
        parallel=parallel,
        tensors={
            name: {"metrics": comp.to_dict(), "verdict": v.to_dict()}
            for name, (comp, v) in tensors.items()
        },
        verdict=_overall(tensors),
        tolerance=tolerance,
        provenance=provenance,
    )


def failed_record(
    *, rule: str, reason: str, provenance: Provenance, **identity: Any
) -> ParityRecord:
    """The record of a cell that crashed, timed out or whose reference touched the
    implementation: an error without tensors. ``identity``: ``patch_id``, ``target``, ``case``,
    ``dtype``, ``parallel`` and optionally ``tolerance``, as for :func:`build_record`."""
    return _record(
        **{"tolerance": None, **identity},
        tensors={},
        verdict=Verdict("error", f"{rule}: {reason}", rule),
        provenance=provenance,
        kernels={},
        npu_kernel_exercised=False,
        benchmark=None,
    )


def _record(
    *,
    parallel: Mapping[str, int],
    verdict: Verdict,
    tolerance: Tolerance | None,
    provenance: Provenance,
    **fields: Any,
) -> ParityRecord:
    return ParityRecord.parse(
        {
            "schema_version": SCHEMA_VERSION,
            **fields,
            "parallel": dict(parallel),
            "device": provenance.device,
            "verdict": verdict.to_dict(),
            "tolerance": None if tolerance is None else tolerance.to_dict(),
            "provenance": provenance.model_dump(),
        },
        f"the record of {fields.get('patch_id')!r}",
    )


def _overall(tensors: Mapping[str, tuple[TensorComparison, Verdict]]) -> Verdict:
    if not tensors:
        raise ValueError("a parity record needs at least one compared tensor")
    name, (_, worst) = max(
        tensors.items(),
        key=lambda kv: (kv[1][1].severity, -_cosine_or_one(kv[1][0])),
    )
    # max() keeps the first maximal item, so ties go to the first tensor in order
    return Verdict(worst.status, f"{name}: {worst.reason}", worst.rule, worst.override)


def _cosine_or_one(c: TensorComparison) -> float:
    return 1.0 if c.cosine is None else c.cosine


# --------------------------------------------------------------------------- files


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part).strip("._") or "_"


def record_filename(
    patch_id: str, case: str, dtype: str, parallel: Mapping[str, int], device: str
) -> str:
    """Deterministic, filesystem-safe file name for one record.

    Readable parts (unsafe characters -> ``_``) plus 10 hex digits of a sha256 over the raw
    key, so two keys that sanitize alike still get different files.
    """
    par = "-".join(f"{k}{parallel[k]}" for k in PARALLEL_KEYS)
    raw = "\x00".join([patch_id, case, dtype, par, device])
    digest = hashlib.sha256(raw.encode("utf-8")).hexdigest()[:10]
    stem = "__".join(_safe(p) for p in (patch_id, case, dtype, par, device))
    return f"{stem[:180]}__{digest}.json"


def write_record(record: ParityRecord, results_dir: str | os.PathLike[str]) -> Path:
    """Write ``record`` atomically into ``results_dir`` (:func:`megatron_npu.files.write_private`:
    a 0640 file, missing directories 0750); return the file's path. A failure at any point leaves
    any previous file intact and no temp file."""
    final = Path(results_dir) / record_filename(
        record.patch_id, record.case, record.dtype, record.parallel.model_dump(), record.device
    )
    return record.write(final)


def read_records(results_dir: str | os.PathLike[str]) -> list[ParityRecord]:
    """Load every ``*.json`` record in ``results_dir`` (sorted by name; hidden temp files skipped).

    Raises FileNotFoundError if the directory is missing, and at the first file that is not a
    record :class:`megatron_npu.formats.FormatError` naming the file and the missing or bad field.
    """
    directory = Path(results_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"parity results directory {str(directory)!r} does not exist")
    return [ParityRecord.read(path) for path in record_files(directory)]


def record_files(directory: Path) -> list[Path]:
    """The record files of a results folder (sorted by name; hidden temp files left out)."""
    return sorted(p for p in directory.glob("*.json") if not p.name.startswith("."))
