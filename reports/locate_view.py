"""The report section of a ``megatron-npu locate`` result: ``locate.json`` of runs of ``train``
or of the user's own script (``--script``), and ``locate-msprobe.json`` of two msprobe dumps
(``--msprobe``); their formats: :mod:`megatron_npu.formats.locate_result` and docs/locate.md.

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

from megatron_npu.formats import FormatError
from megatron_npu.formats.base import Part
from megatron_npu.formats.locate_msprobe import FILENAME as MSPROBE_FILE
from megatron_npu.formats.locate_msprobe import FORMAT as MSPROBE_FORMAT
from megatron_npu.formats.locate_msprobe import LocateMsprobeResult
from megatron_npu.formats.locate_msprobe import Row as MsprobeRow
from megatron_npu.formats.locate_result import FILENAME as LOCATE_FILE
from megatron_npu.formats.locate_result import Divergent, ModuleRow, RunSide, is_locate
from megatron_npu.formats.locate_result import LocateResult as LocateFile

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
    #: the locate.json or the locate-msprobe.json as read
    data: LocateFile | LocateMsprobeResult


def looks_like_locate(data: Any) -> bool:
    return is_locate(data) or _is_msprobe(data)


def _is_msprobe(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == MSPROBE_FORMAT


def parse(data: Any, source: str) -> LocateResult:
    model = LocateMsprobeResult if _is_msprobe(data) else LocateFile
    try:
        return LocateResult(source, model.parse(data, source))
    except FormatError as exc:
        raise BadLocateResult(exc.message) from None  # the skipped entry names the file


def _shown(value: Any) -> Any:
    """A number as locate.json writes it, and so as the page shows it: a non-finite one as
    ``"Infinity"``, ``"-Infinity"`` or ``"NaN"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _as_written(part: Part | None) -> Any:
    """A part of locate.json as plain values, the way the file holds them (:func:`_shown`)."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return _shown(value)

    return None if part is None else plain(part.model_dump(mode="json", exclude_unset=True))


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


def _tree_key(row: ModuleRow) -> tuple:
    module = row.module
    if module == "optimizer":
        return (2, "", row.rank)
    if module == "model":
        return (0, "", row.rank)
    parts = tuple(int(p) if p.isdigit() else p for p in module.split("."))
    return (1, tuple((0, p) if isinstance(p, int) else (1, p) for p in parts), row.rank)


def tree_rows(modules: list[ModuleRow], divergent: Divergent | None) -> list[dict[str, Any]]:
    out = []
    named = divergent.name if divergent else None
    for row in sorted(modules, key=_tree_key):
        module = row.module
        cells = []
        for phase in PHASES:
            info = getattr(row, phase)
            if info is None:
                cell = heat(None, None)
                cell.update(phase=phase, input=None, ratio=None, diverges=False)
            else:
                cell = heat(_shown(info.output), info.tolerance)
                cell.update(
                    phase=phase,
                    input=_shown(info.input),
                    ratio=_shown(info.ratio),
                    diverges=info.diverges,
                )
            cells.append(cell)
        out.append(
            {
                "name": row.name,
                "label": module.rpartition(".")[2] + (f" @{row.shard}" if row.shard else ""),
                "indent": 0 if module in ("model", "optimizer") else module.count(".") + 1,
                "kind": row.kind,
                "cells": cells,
                "named": row.name == named,
                "patches": row.patches.own,
            }
        )
    return out


def _side(side: RunSide) -> dict[str, Any]:
    """A run side as the page names it: its label and device, and the user's script if any."""
    return {**_as_written(side), "script": side.script}


def msprobe_rows(rows: list[MsprobeRow], divergent: MsprobeRow | None) -> list[dict[str, Any]]:
    """The rows of a ``locate --msprobe`` result in dump order, each with one heat cell."""
    named = (divergent.name, divergent.rank) if divergent else None
    return [
        {
            "rank": row.rank,
            "name": row.name,
            "phase": row.phase,
            "kind": row.kind,
            "cell": heat(_shown(row.output), row.tolerance),
            "input": _shown(row.input),
            "diverges": row.diverges,
            "named": (row.name, row.rank) == named,
        }
        for row in rows
    ]


def msprobe_section(result: LocateResult, index: int) -> dict[str, Any]:
    data: LocateMsprobeResult = result.data
    divergent = data.divergent
    return {
        "id": f"locate-msprobe-{index}",
        "mode": "msprobe",
        "source": result.source,
        "reference": data.reference,
        "candidate": data.candidate,
        "task": data.task,
        "levels": data.levels,
        "ranks": data.ranks,
        "statement": data.statement,
        "divergent": _as_written(divergent),
        "metrics": _as_written(divergent.msprobe_metrics) if divergent else None,
        "patches": (divergent.patches or divergent.module_patches or []) if divergent else [],
        "rows": msprobe_rows(data.rows, divergent),
        "unmatched": data.unmatched,
    }


def section(result: LocateResult, index: int) -> dict[str, Any]:
    if isinstance(result.data, LocateMsprobeResult):
        return msprobe_section(result, index)
    found: LocateFile = result.data
    step, culprit, divergent = found.step, found.culprit, found.divergent
    return {
        "id": f"locate-{index}",
        "mode": "script" if found.reference.script else "runs",
        "source": result.source,
        "reference": _side(found.reference),
        "candidate": _side(found.candidate),
        "metrics": _as_written(divergent.msprobe) if divergent else None,
        "step": step.step,
        "step_quantity": step.quantity,
        "step_error": step.rel_error,
        "approximate": step.approximate.status,
        "replayed_step": found.replayed_step,
        "divergent": _as_written(divergent),
        "culprits": culprit.culprits if culprit else [],
        "culprit_note": culprit.note if culprit else "",
        "trials": _as_written(culprit)["trials"] if culprit else [],
        "rows": tree_rows(found.modules, divergent),
        "reproduce": found.reproduce,
        "timing": _as_written(found.timing) or {},
    }
