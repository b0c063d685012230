"""The parity sections: the matrix of cells and the coverage table, both from records and the
registry (every patch, its case and matrix cells come from :mod:`megatron_npu.registry` and
:mod:`megatron_npu.parity.matrix`)."""

from __future__ import annotations

import importlib
from collections import Counter, defaultdict
from typing import Any

from megatron_npu.parity.verdict import ABS_PASS, COSINE_MIN
from megatron_npu.reports.formatting import device_label, number

from megatron_npu.formats.parity_record import SEVERITY, ParityRecord


def worst_status(statuses: list[str]) -> str | None:
    return max(statuses, key=SEVERITY.__getitem__) if statuses else None


def default_tolerance(dtype: str) -> dict[str, Any]:
    """The thresholds :func:`megatron_npu.parity.verdict.verdict` uses when a case has
    no override."""
    rules = importlib.import_module(
        "megatron_npu.parity.verdict"
    )  # megatron_npu.parity.verdict is also a function name
    error_n, warning_n = rules._DUAL_DEFAULTS.get(dtype, (None, None))
    return {
        "cosine": COSINE_MIN,
        "abs_pass": ABS_PASS,
        "dual_error": error_n,
        "dual_warning": warning_n,
    }


def _tensor_rows(tensors: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tensor of a record's decoded JSON (every metric key the file holds)."""
    return [
        {
            "name": name,
            "status": entry["verdict"]["status"],
            "reason": entry["verdict"]["reason"],
            "metrics": [(k, number(v, 6)) for k, v in sorted(entry["metrics"].items())],
        }
        for name, entry in tensors.items()
    ]


def benchmark_section(benchmark: Any) -> dict[str, Any] | None:
    """A schema-2 record's msprobe stage-2 benchmark: per tensor, each metric's error on the
    tested path and on the stock path, their ratio and its limit, and the verdict."""
    if not isinstance(benchmark, dict):
        return None
    tensors = []
    for name, entry in (benchmark.get("tensors") or {}).items():
        if not isinstance(entry, dict):
            continue
        parts = {
            k: entry.get(k) if isinstance(entry.get(k), dict) else {}
            for k in ("tested", "benchmark", "ratios", "limits")
        }
        metrics = list(dict.fromkeys([*parts["ratios"], *parts["tested"], *parts["benchmark"]]))
        verdict = entry.get("verdict") if isinstance(entry.get("verdict"), dict) else {}
        tensors.append(
            {
                "name": name,
                "level": entry.get("level", benchmark.get("level")),
                "status": verdict.get("status", "-"),
                "reason": verdict.get("reason", ""),
                "rows": [
                    (
                        m,
                        *(
                            number(parts[k].get(m), 4)
                            for k in ("tested", "benchmark", "ratios", "limits")
                        ),
                    )
                    for m in metrics
                ],
            }
        )
    return {
        "path": benchmark.get("path", "-"),
        "level": benchmark.get("level", "-"),
        "unavailable": benchmark.get("unavailable"),
        "tensors": tensors,
    }


def matrix_rows(cells: list[ParityRecord]) -> list[dict[str, Any]]:
    """One row per cell, sorted by patch, case, dtype, parallel sizes and device."""
    rows = []
    for cell in sorted(cells, key=lambda c: c.key):
        data = cell.to_data()  # the file's values, non-finite numbers as its strings
        rows.append(
            {
                "key": "|".join(cell.key),
                "patch": cell.patch_id,
                "target": cell.target,
                "case": cell.case,
                "dtype": cell.dtype,
                "parallel": cell.parallel_label,
                "device": device_label(cell.device),
                "status": cell.verdict.status,
                "rule": cell.verdict.rule,
                "reason": cell.verdict.reason,
                "override": cell.verdict.override,
                "tolerance": data["tolerance"],
                "default_tolerance": default_tolerance(cell.dtype),
                "tensors": _tensor_rows(data["tensors"]),
                "kernels": cell.kernels,
                "npu_kernel_exercised": cell.npu_kernel_exercised,
                "benchmark": benchmark_section(data.get("benchmark")),
                "seed": cell.provenance.seed,
                "wall_time_s": number(cell.provenance.wall_time_s),
                "schema_version": cell.schema_version,
                "source": cell.source,
            }
        )
    return rows


def filter_values(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The distinct values of each filterable column, for the filter controls."""
    columns = ("patch", "dtype", "parallel", "device", "status")
    values: dict[str, set[str]] = {c: set() for c in columns}
    for row in rows:
        for c in columns:
            values[c].add(row[c]["name"] if c == "device" else row[c])
    order = {"status": lambda s: SEVERITY.get(s, 99)}
    return {c: sorted(v, key=order.get(c, str)) for c, v in values.items()}


def _expected_cells(devices_seen: set[str]) -> dict[str, set[tuple[str, ...]]]:
    """Per patch, the keys of every cell the registry's matrix defines on ``devices_seen``."""
    from megatron_npu.parity.matrix import cells
    from megatron_npu.parity.metrics import dtype_name

    expected: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for cell in cells(tuple(sorted(devices_seen))):
        parallel = "-".join(f"{k}{v}" for k, v in cell.parallel.as_dict().items())
        expected[cell.patch.id].add(
            (cell.patch.id, cell.case.name, dtype_name(cell.dtype), parallel, cell.device)
        )
    return expected


def coverage_rows(cells: list[ParityRecord]) -> list[dict[str, Any]]:
    """Every registry patch: its case and how many of its matrix cells this report holds, or
    its written exemption; plus any record whose patch the registry does not know."""
    from megatron_npu.parity.case import load_case

    from megatron_npu.registry import all_patches

    by_patch: dict[str, list[ParityRecord]] = defaultdict(list)
    for cell in cells:
        by_patch[cell.patch_id].append(cell)
    expected = _expected_cells({c.device for c in cells})
    rows = []
    for patch in all_patches():
        have = by_patch.pop(patch.id, [])
        want = expected.get(patch.id, set())
        missing = sorted(want - {c.key for c in have})
        rows.append(
            {
                "patch": patch.id,
                "target": patch.target,
                "devices": sorted(patch.devices),
                "case": load_case(patch.parity).name if patch.parity else None,
                "exemption": patch.parity_exempt or None,
                "records": len(have),
                "expected": len(want),
                "missing": [" / ".join(k[1:]) for k in missing],
                "counts": dict(Counter(c.verdict.status for c in have)),
                "worst": worst_status([c.verdict.status for c in have]),
                "in_registry": True,
            }
        )
    for patch_id, have in sorted(by_patch.items()):
        rows.append(
            {
                "patch": patch_id,
                "target": have[0].target,
                "devices": [],
                "case": None,
                "exemption": None,
                "records": len(have),
                "expected": 0,
                "missing": [],
                "counts": dict(Counter(c.verdict.status for c in have)),
                "worst": worst_status([c.verdict.status for c in have]),
                "in_registry": False,
            }
        )
    return rows
