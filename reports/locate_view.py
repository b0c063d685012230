"""The report section of a ``megatron-npu locate`` result: ``locate.json`` of runs of ``train``
or of the user's own script (``--script``), and ``locate-msprobe.json`` of two msprobe dumps
(``--msprobe``); schemas in docs/locate.md.

For ``locate.json``: the model's module tree (indented by the dotted name; one row per module and
shard), each row a heat strip of three cells -- forward, backward, update -- coloured by the
module's error relative to its tolerance (``log10(error / tolerance)``: green well below, amber
near, red beyond), with the error, its inputs' error and the ratio in the cell's tooltip; the named
step, module and patch; the command that reproduces the search; msprobe's metrics of the named
module's worst tensor. For ``locate-msprobe.json``: the first divergent row with msprobe's metrics
and the patches it reaches, what statistics can conclude, and every compared row in dump order as a
heat cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_npu.locate.msprobe_dumps import RESULT_FILE as MSPROBE_FILE
from megatron_npu.locate.msprobe_dumps import RESULT_FORMAT as MSPROBE_FORMAT
from megatron_npu.locate.result import FILENAME as LOCATE_FILE
from megatron_npu.locate.result import LocateResultError, is_locate, validate

PHASES = ("forward", "backward", "update")
__all__ = [
    "LOCATE_FILE",
    "MSPROBE_FILE",
    "BadLocateResult",
    "LocateResult",
    "looks_like_locate",
    "parse",
    "section",
]


class BadLocateResult(ValueError):
    """A locate.json the report cannot use (the reason is shown as a skipped input)."""


@dataclass(frozen=True)
class LocateResult:
    source: str
    data: dict[str, Any]


def looks_like_locate(data: Any) -> bool:
    return is_locate(data) or _is_msprobe(data)


def _is_msprobe(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == MSPROBE_FORMAT


#: the fields a ``locate --msprobe`` result (``locate-msprobe.json``) must have
_MSPROBE_REQUIRED = ("reference", "candidate", "task", "rows", "divergent")


def parse(data: Any, source: str) -> LocateResult:
    if _is_msprobe(data):
        missing = [k for k in _MSPROBE_REQUIRED if k not in data]
        if missing or not isinstance(data.get("rows"), list):
            raise BadLocateResult(
                f"{source}: not a usable {MSPROBE_FORMAT} result (missing or bad: "
                f"{', '.join(missing) or 'rows'})"
            )
        return LocateResult(source, data)
    try:
        return LocateResult(source, validate(data, source))
    except LocateResultError as exc:
        raise BadLocateResult(str(exc)) from None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if value in ("Infinity", "NaN"):
        return math.inf
    return None


def heat(error: Any, tolerance: Any) -> dict[str, Any]:
    """One heat cell: colour and label of ``error`` against ``tolerance``."""
    err, tol = _number(error), _number(tolerance)
    if err is None:
        return {"color": "#eeeeee", "label": "-", "level": None}
    if not tol or tol <= 0:
        tol = 1e-12
    level = math.inf if math.isinf(err) else (math.log10(err / tol) if err > 0 else -6.0)
    # -3 (1000x below the tolerance) .. 0 (at it) .. +1 (10x beyond): hue 120 (green) -> 0 (red)
    clipped = max(-3.0, min(1.0, level))
    hue = 120.0 * (1.0 - clipped) / 4.0 if clipped < 0 else max(0.0, 30.0 - 30.0 * clipped)
    return {"color": f"hsl({hue:.0f}, 75%, 55%)", "label": f"{err:.2e}", "level": level}


def _tree_key(row: dict[str, Any]) -> tuple:
    module = row.get("module", "")
    if module == "optimizer":
        return (2, "", row.get("rank", 0))
    if module == "model":
        return (0, "", row.get("rank", 0))
    parts = tuple(int(p) if p.isdigit() else p for p in module.split("."))
    return (1, tuple((0, p) if isinstance(p, int) else (1, p) for p in parts), row.get("rank", 0))


def tree_rows(modules: list[dict[str, Any]], divergent: dict | None) -> list[dict[str, Any]]:
    out = []
    named = (divergent or {}).get("name")
    for row in sorted(modules, key=_tree_key):
        module = row.get("module", "")
        cells = []
        for phase in PHASES:
            info = row.get(phase) or {}
            cell = heat(info.get("output"), info.get("tolerance"))
            cell.update(
                phase=phase,
                input=info.get("input"),
                ratio=info.get("ratio"),
                diverges=bool(info.get("diverges")),
            )
            cells.append(cell)
        out.append(
            {
                "name": row.get("name", module),
                "label": module.rpartition(".")[2]
                + (f" @{row['shard']}" if row.get("shard") else ""),
                "indent": 0 if module in ("model", "optimizer") else module.count(".") + 1,
                "kind": row.get("kind", ""),
                "cells": cells,
                "named": row.get("name", module) == named,
                "patches": (row.get("patches") or {}).get("own", []),
            }
        )
    return out


def _side(side: Any) -> dict[str, Any]:
    """A run side as the page names it: its label and device, and the user's script if any."""
    side = side if isinstance(side, dict) else {}
    return {
        **side,
        "label": side.get("label", "?"),
        "device": side.get("device", "?"),
        "script": side.get("script"),
    }


def msprobe_rows(rows: list[dict[str, Any]], divergent: dict | None) -> list[dict[str, Any]]:
    """The rows of a ``locate --msprobe`` result in dump order, each with one heat cell."""
    named = ((divergent or {}).get("name"), (divergent or {}).get("rank"))
    out = []
    for row in rows:
        cell = heat(row.get("output"), row.get("tolerance"))
        out.append(
            {
                "rank": row.get("rank", ""),
                "name": row.get("name", ""),
                "phase": row.get("phase", ""),
                "kind": row.get("kind", ""),
                "cell": cell,
                "input": row.get("input"),
                "diverges": bool(row.get("diverges")),
                "named": (row.get("name"), row.get("rank")) == named,
            }
        )
    return out


def msprobe_section(result: LocateResult, index: int) -> dict[str, Any]:
    data = result.data
    divergent = data.get("divergent")
    return {
        "id": f"locate-msprobe-{index}",
        "mode": "msprobe",
        "source": result.source,
        "reference": data.get("reference"),
        "candidate": data.get("candidate"),
        "task": data.get("task"),
        "levels": data.get("levels", []),
        "ranks": data.get("ranks", []),
        "statement": data.get("statement"),
        "divergent": divergent,
        "metrics": (divergent or {}).get("msprobe_metrics"),
        "patches": (divergent or {}).get("patches")
        or (divergent or {}).get("module_patches")
        or [],
        "rows": msprobe_rows(data.get("rows", []), divergent),
        "unmatched": data.get("unmatched", {}),
    }


def section(result: LocateResult, index: int) -> dict[str, Any]:
    if _is_msprobe(result.data):
        return msprobe_section(result, index)
    data = result.data
    step = data.get("step") or {}
    culprit = data.get("culprit") or {}
    divergent = data.get("divergent")
    return {
        "id": f"locate-{index}",
        "mode": "script" if _side(data.get("reference")).get("script") else "runs",
        "source": result.source,
        "reference": _side(data.get("reference")),
        "candidate": _side(data.get("candidate")),
        "metrics": (divergent or {}).get("msprobe"),
        "step": step.get("step"),
        "step_quantity": step.get("quantity"),
        "step_error": step.get("rel_error"),
        "approximate": (step.get("approximate") or {}).get("status"),
        "replayed_step": data.get("replayed_step"),
        "divergent": divergent,
        "culprits": culprit.get("culprits", []),
        "culprit_note": culprit.get("note", ""),
        "trials": culprit.get("trials", []),
        "rows": tree_rows(data.get("modules", []), divergent),
        "reproduce": data.get("reproduce", ""),
        "timing": data.get("timing", {}),
    }
