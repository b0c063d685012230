"""The console summary of a set of parity records: one row per record with its verdict, whether
an NPU cell exercised an NPU kernel, and its worst tensor; the counts; the rich table."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from megatron_npu.parity.results import PARALLEL_KEYS, ParityRecord

from megatron_npu.devices.facts import NPU_DEVICES
from megatron_npu.formats.parity_record import Parallel


class SummaryRow(NamedTuple):
    patch: str
    case: str
    dtype: str
    parallel: str  # "tp2 pp1 dp1 w2", "cp2" before the world where CP is above 1
    device: str
    verdict: str
    npu_code: str  # npu/npu-emulated cells: "NPU kernel" or "same code as cpu"; else "-"
    worst_metric: str  # "<tensor>: <deciding rule and numbers>" of the worst tensor


def _parallel_text(parallel: Parallel) -> str:
    cp = f" cp{parallel.cp}" if parallel.cp > 1 else ""
    return f"tp{parallel.tp} pp{parallel.pp} dp{parallel.dp}{cp} w{parallel.world}"


def summary_table(records: Iterable[ParityRecord]) -> list[SummaryRow]:
    """One row per record, sorted by patch, case, dtype, parallel sizes and device."""
    rows = []
    for rec in records:
        rows.append(
            (
                (
                    rec.patch_id,
                    rec.case,
                    rec.dtype,
                    tuple(getattr(rec.parallel, k) for k in PARALLEL_KEYS),
                    rec.device,
                ),
                SummaryRow(
                    patch=rec.patch_id,
                    case=rec.case,
                    dtype=rec.dtype,
                    parallel=_parallel_text(rec.parallel),
                    device=rec.device,
                    verdict=rec.verdict.status,
                    npu_code=npu_code(rec),
                    worst_metric=rec.verdict.reason,
                ),
            )
        )
    rows.sort(key=lambda item: item[0])
    return [row for _, row in rows]


_STYLE = {"pass": "green", "warning": "yellow", "error": "bold red"}
KERNEL_EXERCISED = "NPU kernel"
SAME_AS_CPU = "same code as cpu"


def npu_code(record: ParityRecord) -> str:
    """What an npu / npu-emulated cell ran: an NPU kernel, or the same code as the cpu cell
    ("unknown" for a schema-1 record); "-" for other devices."""
    if record.device not in NPU_DEVICES:
        return "-"
    if record.npu_kernel_exercised is None:
        return "unknown"
    return KERNEL_EXERCISED if record.npu_kernel_exercised else SAME_AS_CPU


def summary_counts(records: Iterable[ParityRecord]) -> dict[str, Any]:
    """Verdict counts, failed cells (crash / timeout / reference hygiene) and, per NPU device,
    how many cells exercised an NPU kernel and how many ran the same code as cpu."""
    records = list(records)
    verdicts: dict[str, int] = {}
    failed: dict[str, int] = {}
    npu: dict[str, dict[str, int]] = {}
    for rec in records:
        verdicts[rec.verdict.status] = verdicts.get(rec.verdict.status, 0) + 1
        if not rec.tensors:
            failed[rec.verdict.rule] = failed.get(rec.verdict.rule, 0) + 1
        if rec.device in NPU_DEVICES:
            per = npu.setdefault(rec.device, {})
            key = npu_code(rec)
            per[key] = per.get(key, 0) + 1
    return {"records": len(records), "verdicts": verdicts, "failed": failed, "npu": npu}


def summary_lines(records: Iterable[ParityRecord]) -> list[str]:
    """The summary's count lines (what ``megatron-npu parity`` prints under the table)."""
    c = summary_counts(records)
    lines = [
        f"{c['records']} records: "
        + ", ".join(f"{n} {s}" for s, n in sorted(c["verdicts"].items()))
    ]
    if c["failed"]:
        lines.append(
            "cells that failed before comparing: "
            + ", ".join(f"{n} {rule}" for rule, n in sorted(c["failed"].items()))
        )
    for device, per in sorted(c["npu"].items()):
        lines.append(
            f"{device} cells: {per.get(KERNEL_EXERCISED, 0)} exercised an NPU kernel, "
            f"{per.get(SAME_AS_CPU, 0)} ran the same code as cpu"
            + (f", {per['unknown']} unknown (schema 1)" if per.get("unknown") else "")
        )
    return lines


def print_summary(records: Iterable[ParityRecord], console: Any = None) -> Any:
    """Print :func:`summary_table` as a rich table (to ``console``, or the console's table
    console on standard output); return it."""
    from rich.table import Table

    from megatron_npu.console import tables

    table = Table(title="parity results")
    for column in SummaryRow._fields:
        table.add_column(column.replace("_", " "))
    for row in summary_table(records):
        cells = list(row)
        cells[5] = f"[{_STYLE[row.verdict]}]{row.verdict}[/]"
        table.add_row(*cells)
    (console if console is not None else tables()).print(table)
    return table
