"""The end-to-end sections of a ``compare`` result: the loss and grad-norm curves of every run,
the verdict matrix (candidates x rules), each curve rule's per-step relative differences of all
candidates overlaid with the tolerance band, and Table 2."""

from __future__ import annotations

from typing import Any

from megatron_npu.reports import charts
from megatron_npu.reports.compare_results import Comparison
from megatron_npu.reports.formatting import command_line, device_label, number

from megatron_npu.compare import table2 as compare_table
from megatron_npu.formats.compare_results import Verdict

FAILING = ("fail", "refused")

#: Tolerance keys (docs/compare-results.md) that bound every step's relative loss difference:
#: ``rtol`` of the approximate rule, ``per_step_rel`` of the layout rule. The deterministic
#: rule's ``bitwise`` limits are a band of zero.
RELATIVE_KEYS = ("rtol", "per_step_rel")
BITWISE = "bitwise"


def band(tolerance: Any) -> float | None:
    """The per-step relative bound of a verdict's tolerance, if it has one."""
    if not isinstance(tolerance, dict):
        return None
    for key in RELATIVE_KEYS:
        value = tolerance.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    if BITWISE in tolerance.values():
        return 0.0
    return None


def _finite_or_none(values: Any) -> list[float | None]:
    """Plot values: non-finite figures (written as "NaN"/"Infinity" strings) become gaps."""
    if not isinstance(values, list):
        return []
    return [v if isinstance(v, int | float) and not isinstance(v, bool) else None for v in values]


def _legend(run: Any) -> str:
    text = f"{run.name} ({run.device or 'no device'})"
    if run.emulated:
        text += " [emulated]"
    if not run.iterations:
        text += f" - no steps ({run.status})"
    return text


def _tolerance_text(tolerance: Any) -> str:
    if not isinstance(tolerance, dict):
        return ""
    return " ".join(f"{k}={number(v)}" for k, v in sorted(tolerance.items()))


def verdict_matrix(comp: Comparison) -> dict[str, Any]:
    """Candidates x rules: one row per (candidate, baseline) pair, one cell per rule with its
    status (the badge) and its detail and tolerance (shown on hover and on expanding the cell);
    a rule that did not judge a pair leaves its cell empty."""
    rules: list[str] = []
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for v in comp.verdicts:
        if v.rule not in rules:
            rules.append(v.rule)
        key = (v.candidate, v.baseline)
        row = rows.setdefault(key, {"candidate": key[0], "baseline": key[1], "cells": {}})
        row["cells"][v.rule] = {
            "status": v.status,
            "detail": v.detail,
            "tolerance": _tolerance_text(v.tolerance),
        }
    return {"rules": rules, "rows": list(rows.values())}


def overlays(comp: Comparison, index: int) -> list[dict[str, Any]]:
    """One chart per curve rule: every candidate's per-step relative difference against its
    baseline, overlaid, with the rule's tolerance band (drawn when the pairs share one)."""
    by_rule: dict[str, list[Verdict]] = {}
    for v in comp.verdicts:
        if v.per_step and v.per_step.get("iteration"):
            by_rule.setdefault(v.rule, []).append(v)
    out = []
    for j, (rule, verdicts) in enumerate(by_rule.items()):
        bands = {band(v.tolerance) for v in verdicts}
        shared = next(iter(bands)) if len(bands) == 1 else None
        series = [
            {
                "legend": f"{v.candidate} vs {v.baseline}",
                "iterations": v.per_step.get("iteration", []),
                "rel_diff": _finite_or_none(v.per_step.get("rel_diff")),
            }
            for v in verdicts
        ]
        step_bands = list(
            {
                v.baseline: {
                    "legend": f"rounding band of {v.baseline}",
                    "iterations": v.per_step.get("iteration", []),
                    "band": _finite_or_none(v.per_step.get("band")),
                }
                for v in verdicts
                if v.per_step.get("band")
            }.values()
        )
        plot = charts.relative_differences(
            f"{rule}: relative loss difference per step",
            series,
            shared,
            f"reldiff-{index}-{j}",
            step_bands,
        )
        out.append(
            {
                "rule": rule,
                "band": shared,
                "bands_differ": len(bands) > 1,
                "plot": plot,
                "step_bands": [b["legend"] for b in step_bands],
                "pairs": [
                    {
                        "candidate": v.candidate,
                        "baseline": v.baseline,
                        "status": v.status,
                        "detail": v.detail,
                    }
                    for v in verdicts
                ],
            }
        )
    return out


def comparison_section(comp: Comparison, index: int) -> dict[str, Any]:
    runs = [
        {"iterations": r.iterations, "losses": r.losses, "legend": _legend(r)} for r in comp.runs
    ]
    loss_div = charts.loss_curves(f"{comp.title}: loss per step", runs, f"loss-{index}")
    with_norms = [r for r in comp.runs if r.iterations and any(g is not None for g in r.grad_norms)]
    grad_div = (
        charts.grad_norms(
            f"{comp.title}: grad norm per step",
            [
                {"iterations": r.iterations, "grad_norms": r.grad_norms, "legend": _legend(r)}
                for r in with_norms
            ],
            f"gradnorm-{index}",
        )
        if with_norms
        else None
    )
    return {
        "title": comp.title,
        "source": comp.source,
        "matrix": comp.matrix,
        "baseline": comp.baseline,
        "run_count": len(comp.runs),
        "run_names": [r.name for r in comp.runs],
        "loss_div": loss_div,
        "grad_div": grad_div,
        "verdict_matrix": verdict_matrix(comp),
        "overlays": overlays(comp, index),
        "failed_runs": [
            {"name": r.name, "status": r.status, "error": r.error} for r in comp.runs if r.error
        ],
        "table2": table2(comp),
        "not_run": comp.skipped_runs,
        "notes": comp.notes,
    }


def _cell_text(key: str, row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Table 2's own cell text (megatron_npu.compare.table2), or the plain number when a damaged
    file gives a value of another type."""
    try:
        return compare_table.cell(key, row, rows)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError):
        return number(row.get(key))


def _has_column(key: str, rows: list[dict[str, Any]]) -> bool:
    if key == "cloze":
        return any(k in row for row in rows for k in ("cloze_nll", "cloze_accuracy"))
    return any(key in row for row in rows)


def table2(comp: Comparison) -> dict[str, Any]:
    """Table 2 as ``compare`` prints it: the same columns, labels (with units) and cell texts
    (:mod:`megatron_npu.compare.table2`); a column no row has is left out."""
    rows_in = comp.table2
    columns = [(k, label) for k, label in compare_table.labels(rows_in) if _has_column(k, rows_in)]
    rows = []
    for row in rows_in:
        device = row.get("device")
        emulated = row.get("emulated")
        cells = {}
        for key, _ in columns:
            if key == "device" and isinstance(device, str):
                cells[key] = device_label(device, emulated if isinstance(emulated, bool) else None)
                hardware = row.get("hardware")
                cells[key]["hardware"] = hardware if isinstance(hardware, str) else ""
            else:
                value = row.get(key)
                numeric = isinstance(value, int | float) and not isinstance(value, bool)
                cells[key] = {"text": _cell_text(key, row, rows_in), "numeric": numeric}
        rows.append(cells)
    return {
        "columns": [k for k, _ in columns],
        "labels": dict(columns),
        "rows": rows,
        "notes": [compare_table.MEMORY_NOTE]  # the page labels emulated devices itself
        + (
            [compare_table.EMULATED_NOTE.replace("`*` ", "")]
            if any(r.get("emulated") for r in rows_in)
            else []
        ),
    }


def headline(comps: list[Comparison]) -> dict[str, Any] | None:
    """One line for the top of the page: did every comparison pass, and if not which rule
    failed for which run (and which runs did not finish)."""
    if not comps:
        return None
    problems = []
    for comp in comps:
        where = f" ({comp.title})" if len(comps) > 1 else ""
        for run in comp.runs:
            if run.status == "failed":
                problems.append(f"run {run.name} failed{where}")
        for v in comp.verdicts:
            if v.status in FAILING:
                problems.append(f"{v.rule} {v.status} for {v.candidate} vs {v.baseline}{where}")
    if not problems:
        runs = sum(len(c.runs) for c in comps)
        return {"passed": True, "text": f"Comparison passed: {runs} runs, no rule failed."}
    return {"passed": False, "text": "Comparison FAILED: " + "; ".join(problems) + "."}


def run_provenance(comp: Comparison) -> list[dict[str, Any]]:
    return [
        {
            "name": r.name,
            "device": device_label(r.device or "none", r.emulated),
            "status": r.status,
            "command": command_line(r.command),
            "seed": r.options.get("seed", r.options.get("--seed")),
            "wall_s": number(r.wall_s),
        }
        for r in comp.runs
    ]
