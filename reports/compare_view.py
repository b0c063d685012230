"""The end-to-end sections of a ``compare`` result: loss curves with every rule's verdict, the
per-step relative difference with its tolerance band, and Table 2."""

from __future__ import annotations

from typing import Any

from reports import charts
from reports.compare_results import Comparison
from reports.formatting import command_line, device_label, number

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
    for j, v in enumerate(comp.verdicts):
        per_step = v.get("per_step") or None
        plot = None
        if isinstance(per_step, dict) and per_step.get("iteration"):
            plot = charts.relative_difference(
                f"{v['candidate']} vs {v['baseline']}: {v['rule']}",
                per_step.get("iteration", []), _finite_or_none(per_step.get("rel_diff")),
                band(v.get("tolerance")), f"reldiff-{index}-{j}",
            )  # fmt: skip
        verdicts.append(
            {
                "candidate": v["candidate"], "baseline": v["baseline"], "rule": v["rule"],
                "status": v["status"], "detail": v.get("detail") or "",
                "tolerance": v.get("tolerance") or {}, "band": band(v.get("tolerance")),
                "plot": plot,
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


def table2(comp: Comparison) -> dict[str, Any]:
    """Table 2 as the results file gives it: its columns are the rows' keys, in their order."""
    columns: list[str] = []
    for row in comp.table2:
        columns.extend(k for k in row if k not in columns and k != "emulated")
    rows = []
    for row in comp.table2:
        device = row.get("device")
        emulated = row.get("emulated")
        cells = {}
        for col in columns:
            value = row.get(col)
            if col == "device" and isinstance(device, str):
                cells[col] = device_label(device, emulated if isinstance(emulated, bool) else None)
            else:
                numeric = isinstance(value, int | float | list) and not isinstance(value, bool)
                cells[col] = {"text": number(value), "numeric": numeric}
        rows.append(cells)
    return {"columns": columns, "rows": rows}


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
