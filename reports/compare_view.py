"""The end-to-end sections of a ``compare`` result: loss curves with every rule's verdict, the
per-step relative difference with its tolerance band, and Table 2."""

from __future__ import annotations

from typing import Any

from megatron_npu.reports import charts
from megatron_npu.reports.compare_results import Comparison
from megatron_npu.reports.formatting import command_line, device_label, number

from megatron_npu.compare import table2 as compare_table

#: Rules whose verdicts compare two training curves (a grad-norm plot is drawn for each pair).
CURVE_RULES = ("deterministic", "layout", "approximate")
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


def comparison_section(comp: Comparison, index: int) -> dict[str, Any]:
    runs = [
        {"iterations": r.iterations, "losses": r.losses, "legend": _legend(r)} for r in comp.runs
    ]
    loss_div = charts.loss_curves(f"{comp.title}: loss per step", runs, f"loss-{index}")
    verdicts = []
    by_name = {r.name: r for r in comp.runs}
    for j, v in enumerate(comp.verdicts):
        per_step = v.get("per_step") or None
        plot = None
        if isinstance(per_step, dict) and per_step.get("iteration"):
            plot = charts.relative_difference(
                f"{v['candidate']} vs {v['baseline']}: {v['rule']}",
                per_step.get("iteration", []), _finite_or_none(per_step.get("rel_diff")),
                band(v.get("tolerance")), f"reldiff-{index}-{j}",
            )  # fmt: skip
        pair = [by_name.get(v["candidate"]), by_name.get(v["baseline"])]
        grad_plot = None
        if v["rule"] in CURVE_RULES and all(r is not None and r.iterations for r in pair):
            grad_plot = charts.grad_norms(
                f"{v['candidate']} vs {v['baseline']}: grad norm per step",
                [{"iterations": r.iterations, "grad_norms": r.grad_norms, "legend": _legend(r)}
                 for r in pair],
                f"gradnorm-{index}-{j}",
            )  # fmt: skip
        verdicts.append(
            {
                "candidate": v["candidate"], "baseline": v["baseline"], "rule": v["rule"],
                "status": v["status"], "detail": v.get("detail") or "",
                "tolerance": v.get("tolerance") or {}, "band": band(v.get("tolerance")),
                "plot": plot, "grad_plot": grad_plot,
            }
        )  # fmt: skip
    return {
        "title": comp.title,
        "source": comp.source,
        "matrix": comp.matrix,
        "baseline": comp.baseline,
        "run_count": len(comp.runs),
        "run_names": [r.name for r in comp.runs],
        "loss_div": loss_div,
        "verdicts": verdicts,
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
            if v.get("status") in FAILING:
                problems.append(
                    f"{v['rule']} {v['status']} for {v['candidate']} vs {v['baseline']}{where}"
                )
    if not problems:
        runs = sum(len(c.runs) for c in comps)
        return {"passed": True, "text": f"Comparison passed: {runs} runs, no rule failed."}
    return {"passed": False, "text": "Comparison FAILED: " + "; ".join(problems) + "."}


def run_provenance(comp: Comparison) -> list[dict[str, Any]]:
    return [
        {
            "name": r.name, "device": device_label(r.device or "none", r.emulated), "status": r.status,
            "command": command_line(r.command),
            "seed": r.options.get("seed", r.options.get("--seed")),
            "wall_s": number(r.wall_s),
        }
        for r in comp.runs
    ]  # fmt: skip
