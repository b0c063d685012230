"""Diff mode: what changed between an old result set (``--diff-base``) and a new one.

* parity: cells that became ``error`` (new errors, including new cells that are errors), cells
  whose verdict improved (fixed), other verdict changes, cells that appeared or disappeared, and
  metric shifts beyond tolerance: a judged metric (cosine, max abs error, the dual-N shares)
  that moved by more than half of its tolerance band, the gap between its ideal value and the
  threshold the verdict applies (the override's, else the default of
  :mod:`megatron_npu.parity.verdict`);
* end-to-end: rule verdicts whose status changed, and s/step changes where both 95 % intervals
  exist and do not overlap (emulated runs are never compared for speed);
* benchmarks: median changes whose interquartile ranges do not overlap (not for emulated ones).
"""

from __future__ import annotations

from typing import Any

from megatron_npu.parity.metrics import DUAL_LEVELS
from megatron_npu.reports.bench_view import speed_flag
from megatron_npu.reports.formatting import device_label, number
from megatron_npu.reports.inputs import ResultSet
from megatron_npu.reports.parity_view import SEVERITY, default_tolerance

from megatron_npu.formats.parity_record import ParityRecord

#: A judged metric has shifted when it moved by more than this share of its tolerance band.
SHIFT_SHARE = 0.5


def _bands(cell: ParityRecord) -> dict[str, float]:
    """Tolerance band (ideal minus threshold) of each judged metric of ``cell``."""
    tol = dict(default_tolerance(cell.dtype))
    for key, value in (cell.tolerance.model_dump() if cell.tolerance else {}).items():
        if value is not None and key in tol:
            tol[key] = value
    bands = {"cosine": 1.0 - tol["cosine"], "max_abs_error": tol["abs_pass"]}
    field_of = {level: f"dual_{name}" for name, level in DUAL_LEVELS.items()}
    for level in (tol["dual_error"], tol["dual_warning"]):
        if level in field_of:
            bands[field_of[level]] = level
    return bands


def _metric_shifts(old: ParityRecord, new: ParityRecord) -> list[dict[str, Any]]:
    bands = _bands(new)
    out = []
    old_tensors = old.to_data()["tensors"]
    for tensor, entry in new.to_data()["tensors"].items():
        before = old_tensors.get(tensor, {}).get("metrics", {})
        after = entry["metrics"]
        for metric, width in bands.items():
            a, b = before.get(metric), after.get(metric)
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b)):
                continue
            if abs(b - a) > SHIFT_SHARE * width:
                out.append(
                    {
                        "cell": new.label,
                        "tensor": tensor,
                        "metric": metric,
                        "old": number(a, 6),
                        "new": number(b, 6),
                        "band": number(width, 3),
                    }
                )
    return out


def _cell_row(old: ParityRecord | None, new: ParityRecord | None) -> dict[str, Any]:
    cell = new or old
    assert cell is not None
    return {
        "cell": cell.label,
        "key": "|".join(cell.key),
        "device": device_label(cell.device),
        "old": old.verdict.status if old else "absent",
        "new": new.verdict.status if new else "absent",
        "reason": cell.verdict.reason,
    }


def parity_diff(
    old: list[ParityRecord], new: list[ParityRecord]
) -> dict[str, list[dict[str, Any]]]:
    before = {c.key: c for c in old}
    after = {c.key: c for c in new}
    out: dict[str, list[dict[str, Any]]] = {
        "new_errors": [],
        "fixed": [],
        "other_changes": [],
        "appeared": [],
        "disappeared": [],
        "metric_shifts": [],
    }
    for key in sorted(set(before) | set(after)):
        o, n = before.get(key), after.get(key)
        if (
            n is not None
            and n.verdict.status == "error"
            and (o is None or o.verdict.status != "error")
        ):
            out["new_errors"].append(_cell_row(o, n))
        elif o is None:
            out["appeared"].append(_cell_row(None, n))
        elif n is None:
            out["disappeared"].append(_cell_row(o, None))
        elif SEVERITY[n.verdict.status] < SEVERITY[o.verdict.status]:
            out["fixed"].append(_cell_row(o, n))
        elif n.verdict.status != o.verdict.status:
            out["other_changes"].append(_cell_row(o, n))
        if o is not None and n is not None:
            out["metric_shifts"].extend(_metric_shifts(o, n))
    return out


def _overlap(a: Any, b: Any) -> bool | None:
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2):
        return None
    return not (a[1] < b[0] or b[1] < a[0])


def compare_diff(old: ResultSet, new: ResultSet) -> dict[str, list[dict[str, Any]]]:
    before = {c.title: c for c in old.comparisons}
    verdicts, speed = [], []
    for comp in new.comparisons:
        base = before.get(comp.title) or (old.comparisons[0] if len(old.comparisons) == 1 else None)
        if base is None:
            continue
        old_v = {(v.candidate, v.baseline, v.rule): v for v in base.verdicts}
        for v in comp.verdicts:
            prev = old_v.get((v.candidate, v.baseline, v.rule))
            if prev is not None and prev.status != v.status:
                verdicts.append(
                    {
                        "comparison": comp.title,
                        "candidate": v.candidate,
                        "baseline": v.baseline,
                        "rule": v.rule,
                        "old": prev.status,
                        "new": v.status,
                        "detail": v.detail,
                    }
                )
        for run in comp.runs:
            prev = base.run(run.name)
            if prev is None or run.emulated or prev.emulated:
                continue
            a, b = prev.perf, run.perf
            if not (a and b and a.speed_comparable and b.speed_comparable):
                continue
            old_s, new_s = a.median_s_per_step, b.median_s_per_step
            if old_s and new_s and _overlap(a.ci95_s_per_step, b.ci95_s_per_step) is False:
                speed.append(
                    {
                        "what": f"{comp.title}: {run.name}",
                        "device": device_label(run.device or "none"),
                        "old": number(old_s),
                        "new": number(new_s),
                        "ratio": number(new_s / old_s, 3),
                        "flag": "slower" if new_s > old_s else "faster",
                    }
                )
    return {"verdicts": verdicts, "speed": speed}


def benchmark_diff(old: ResultSet, new: ResultSet) -> list[dict[str, Any]]:
    before = {(b.fullname, b.device, b.path): b for b in old.benches}
    out = []
    for bench in new.benches:
        prev = before.get((bench.fullname, bench.device, bench.path))
        if prev is None or bench.emulated or prev.emulated:
            continue
        flag = speed_flag(bench, prev)
        if flag != "same":
            out.append(
                {
                    "what": f"{bench.op} [{bench.path}] {bench.name}",
                    "device": device_label(bench.device),
                    "old": number(prev.median),
                    "new": number(bench.median),
                    "ratio": number(bench.median / prev.median, 3),
                    "flag": flag,
                }
            )
    return out


def diff(old: ResultSet, new: ResultSet) -> dict[str, Any]:
    parity = parity_diff(old.parity, new.parity)
    compare = compare_diff(old, new)
    speed = compare["speed"] + benchmark_diff(old, new)
    emulated_skipped = sum(1 for b in new.benches if b.emulated) + sum(
        1 for c in new.comparisons for r in c.runs if r.emulated
    )
    return {
        "base_sources": old.sources,
        "base_skipped": old.skipped,
        "parity": parity,
        "verdict_changes": compare["verdicts"],
        "speed_changes": speed,
        "emulated_not_compared": emulated_skipped,
        "total": sum(len(v) for v in parity.values()) + len(compare["verdicts"]) + len(speed),
    }
