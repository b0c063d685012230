"""``megatron-npu compare [MATRIX.toml] [--out DIR]``: run a matrix, judge it, write Table 2.

Runs execute one after another (train's progress lines are shown), each cached by config hash
(:mod:`.runner`); a failed run is reported and the rest go on. Then, per candidate, the rules of
:mod:`.rules` give one verdict each against its reference (fingerprint first; then
``deterministic`` for a rerun, ``layout`` for an fp32 run on the same device whose options differ
only in layout options, ``approximate`` otherwise) and ``performance`` against its speed reference,
like for like only; a slowdown between two local runs stands only when re-timing both back to back
shows it again (:func:`.slowdown.confirm_slowdown`). Imported runs (:mod:`.imports`,
:mod:`.imported_run`) and script runs (:func:`.runner.execute_script`) take part like trained ones.
The verdicts are :mod:`.judging`'s, the results entries and Table 2 rows :mod:`.result_rows`'.
Outputs: ``<out>/results.json``, ``<out>/table2.md``, ``<out>/runs/<name>/metrics.json``, and the
report of the reports package (``<out>/report.html``) when that package is importable.

Exit status: 0 when every run finished and no verdict failed or was refused (performance
included: it only times like-for-like pairs, see :func:`.rules.speed_mismatch`); 1 otherwise; 2
for a matrix that cannot be used.
"""

from __future__ import annotations

import importlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from megatron_npu import console
from megatron_npu.compare import results as results_mod
from megatron_npu.compare import rules, runner, table2
from megatron_npu.compare.imported_run import import_run
from megatron_npu.compare.judging import (
    RunResult,
    judge,
    noise_cell,
    speed_reference,
    verdict_cell,
)
from megatron_npu.compare.matrix import Matrix
from megatron_npu.compare.result_rows import run_entry, table_row
from megatron_npu.compare.slowdown import confirm_slowdown
from megatron_npu.formats import FormatError
from megatron_npu.formats.metrics import MetricsFile

DEFAULT_OUT = "compare-out"


def build_report(out_dir: Path) -> Path | None:
    """``reports.build_report([out_dir], out_dir / "report.html")`` when the reports package is
    importable; otherwise say so (nothing else is lost: results.json is already written)."""
    try:  # through sys.modules, so a stand-in module (tests) or a missing one is what is used
        reports = importlib.import_module("megatron_npu.reports")
    except ImportError:
        console.say(
            " [compare] no report.html: the `reports` package is not importable here "
            "(results.json and table2.md are written)"
        )
        return None
    try:
        path = Path(reports.build_report([out_dir], out_dir / "report.html"))
    except Exception as exc:  # the comparison is done; a report failure must not hide it
        console.say(f" [compare] report.html failed: {type(exc).__name__}: {exc}")
        return None
    console.say(f" [compare] report: {path}")
    return path


def run_compare(
    matrix: Matrix, out_dir: Path, *, argv: list[str] | None = None
) -> tuple[dict[str, Any], int]:
    """Run, judge and write one comparison; returns (the results document as the plain data
    results.json holds, non-finite numbers as floats; exit status)."""
    s = matrix.settings
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for note in matrix.notes:
        console.say(f" [compare] {note}")
    results: dict[str, RunResult] = {}
    skipped: list[dict[str, str]] = []
    session = uuid.uuid4().hex[:12]
    for spec in matrix.runs:
        if spec.kind == "import":
            results[spec.name] = import_run(spec)
            continue
        device = runner.resolve_device(spec)
        if device is None:
            reason = f"none of its devices ({', '.join(spec.devices)}) is available here"
            if spec.optional:
                console.say(f" [compare] {spec.name}: skipped, {reason}")
                skipped.append({"name": spec.name, "reason": reason})
                continue
            results[spec.name] = RunResult(
                spec, None, runner.Outcome("failed", reason, 0.0, [], "")
            )
            continue
        run_dir = out_dir / "runs" / spec.name
        if spec.kind == "script":
            outcome = runner.execute_script(
                spec,
                device,
                run_dir,
                timeout_s=spec.timeout_s or s.timeout_s,
                session=session,
            )
        else:
            outcome = runner.execute(
                spec,
                device,
                run_dir,
                corpus_dir=out_dir / "corpus",
                timeout_s=spec.timeout_s or s.timeout_s,
                rerun_index=1 if spec.rerun_of else 0,
                checkpoint=s.lambada,
                session=session,
            )
        result = RunResult(spec, device, outcome)
        if outcome.status in ("ok", "cached"):
            try:
                result.metrics = MetricsFile.read(run_dir / "metrics.json")
            except FormatError as exc:
                outcome.status, outcome.error = "failed", f"its metrics.json cannot be used: {exc}"
        else:
            console.say(f" [compare] {spec.name}: FAILED ({outcome.error})")
        if s.lambada and result.ok and spec.kind == "train":
            result.lambada = outcome.lambada
            if result.lambada is None:
                result.lambada, why = runner.evaluate_lambada(
                    spec, device, run_dir, s.lambada_data, timeout_s=s.timeout_s
                )
                if why:
                    result.notes.append(f"LAMBADA evaluation failed: {why}")
                    console.say(f" [compare] {spec.name}: LAMBADA evaluation failed ({why})")
        results[spec.name] = result
    base = results.get(s.baseline)
    verdicts: list[rules.Verdict] = []
    for result in results.values():
        if not result.spec.judged or not result.ok or base is None:
            continue
        other = results.get(speed_reference(result, results, s.baseline))
        verdicts += judge(result, results[result.spec.reference], other, matrix, results)
    verdicts = [
        confirm_slowdown(v, results, matrix, out_dir) if v.rule == "performance" else v
        for v in verdicts
    ]
    entries = [run_entry(r, s.warmup_steps) for r in results.values()]
    rows = [
        table_row(r, e, verdict_cell(r, verdicts, s.baseline), noise_cell(r, verdicts))
        for r, e in zip(results.values(), entries, strict=True)
    ]
    document = results_mod.document(
        matrix=matrix.source,
        baseline=s.baseline,
        runs=entries,
        verdicts=[v.as_dict() for v in verdicts],
        table2=rows,
        skipped=skipped,
        notes=list(matrix.notes),
        argv=argv,
    )
    title = f"Table 2: {matrix.source} matrix, baseline {s.baseline}"
    text = table2.markdown(rows, title)
    results_path, table_path = results_mod.write(out_dir, document, text)
    console.say("\n" + text)
    for v in verdicts:
        console.say(f" {v.candidate:<22} {v.rule:<13} {v.status:<14} {v.detail}")
    for item in skipped:
        console.say(f" {item['name']:<22} skipped: {item['reason']}")
    wall = time.perf_counter() - started
    console.say(
        f"\n [compare] wrote {results_path} and {table_path} ({len(results)} runs, {wall:.0f} s)"
    )
    build_report(out_dir)
    bad_runs = any(not r.ok for r in results.values())
    bad_verdicts = any(v.status in (rules.FAIL, rules.REFUSED) for v in verdicts)
    return document.model_dump(exclude_unset=True), 1 if bad_runs or bad_verdicts else 0


def add_arguments(parser) -> None:
    parser.add_argument(
        "matrix", nargs="?", default=None, help="matrix TOML (default: the shipped default matrix)"
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )


def main(args) -> int:
    from megatron_npu.compare.matrix import MatrixError, load

    try:
        matrix = load(args.matrix)
    except MatrixError as exc:
        console.error(f"megatron-npu compare: {exc}")
        return 2
    try:
        _, status = run_compare(matrix, Path(args.out), argv=sys.argv)
    except OSError as exc:
        console.error(f"megatron-npu compare: {exc}")
        return 2
    return status
