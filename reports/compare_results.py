"""``megatron-npu compare`` results (``<out>/results.json``, the format of
:mod:`megatron_npu.formats.compare_results`), as the report draws them.

One results file is one comparison: several training runs of the same model, a baseline run,
rule verdicts (candidate vs baseline, with per-step relative differences) and the Table 2 rows.
Reading validates the file against its format and names the first bad field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_npu.formats import FormatError
from megatron_npu.formats.compare_results import SCHEMA as COMPARE_SCHEMA
from megatron_npu.formats.compare_results import CompareResults, Perf, Skipped, Verdict
from megatron_npu.formats.compare_results import Run as RunEntry
from megatron_npu.formats.lambada_result import LambadaResult

RESULTS_FILE = "results.json"


class BadCompareResults(ValueError):
    """A results.json that cannot be shown; names the field."""


@dataclass(frozen=True)
class Run:
    name: str
    device: str | None  # None: none of the run's devices was available
    emulated: bool
    status: str
    error: str | None
    command: list[str]
    options: dict[str, Any]
    iterations: list[int]
    losses: list[float | None]  # None: a skipped step or a non-finite loss (a gap in the plot)
    grad_norms: list[float | None]
    perf: Perf | None
    lambada: LambadaResult | None
    wall_s: float | None


@dataclass(frozen=True)
class Comparison:
    source: str
    title: str
    matrix: str | None
    created: str | None
    baseline: str | None
    provenance: dict[str, Any]  # shown key by key
    runs: list[Run]
    verdicts: list[Verdict]
    #: the rows as :func:`megatron_npu.compare.table2.cell` reads them: the keys the file has
    table2: list[dict[str, Any]]
    skipped_runs: list[Skipped]  # optional runs not run here, with the reason
    notes: list[str]

    def run(self, name: str) -> Run | None:
        return next((r for r in self.runs if r.name == name), None)


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _run(entry: RunEntry) -> Run:
    return Run(
        name=entry.name,
        device=entry.device,
        emulated=entry.emulated,
        status=entry.status,
        error=entry.error,
        command=entry.command,
        options=entry.options,
        iterations=[s.iteration for s in entry.steps],
        losses=[_finite(s.loss) for s in entry.steps],
        grad_norms=[_finite(s.grad_norm) for s in entry.steps],
        perf=entry.perf,
        lambada=entry.lambada,
        wall_s=_finite(entry.wall_s),
    )


def comparison(results: CompareResults, source: str) -> Comparison:
    provenance = results.provenance
    return Comparison(
        source=source,
        title=Path(source).parent.name or source,
        matrix=results.matrix,
        created=results.created,
        baseline=results.baseline,
        provenance=provenance.model_dump(exclude_unset=True) if provenance else {},
        runs=[_run(r) for r in results.runs],
        verdicts=results.verdicts,
        table2=[row.model_dump(exclude_unset=True) for row in results.table2],
        skipped_runs=results.skipped,
        notes=results.notes,
    )


def parse(data: Any, source: str) -> Comparison:
    try:
        return comparison(CompareResults.parse(data, source), source)
    except FormatError as exc:
        raise BadCompareResults(exc.message) from None


def looks_like_compare(data: Any) -> bool:
    return isinstance(data, dict) and data.get("schema") == COMPARE_SCHEMA


def read(path: Path) -> Comparison:
    try:
        return comparison(CompareResults.read(path), str(path))
    except FormatError as exc:
        raise BadCompareResults(exc.message) from None
