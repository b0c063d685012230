"""Benchmark comparisons: op x path, median with spread, ratio to the stock Megatron path.

Paths of one op line up when they share op, dtype, shape, direction and device. A path is
flagged ``slower`` (a regression against the baseline path) or ``faster`` only when its
interquartile range does not overlap the baseline's: a difference inside the spread is noise.
Emulated timings are shown but never compared: the emulation's speed says nothing about an NPU.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from megatron_npu.reports import charts
from megatron_npu.reports.benchmarks import BASELINE_PATH, Bench
from megatron_npu.reports.formatting import device_label, number

NOT_COMPARED_EMULATED = "not compared: emulated timing"
NO_BASELINE = f"no {BASELINE_PATH} baseline"


def speed_flag(candidate: Bench, baseline: Bench) -> str:
    """``slower`` / ``faster`` when the two interquartile ranges do not overlap, else ``same``."""
    if candidate.q1 > baseline.q3:
        return "slower"
    if candidate.q3 < baseline.q1:
        return "faster"
    return "same"


def lines(benches: list[Bench]) -> list[dict[str, Any]]:
    grouped: dict[tuple[str, ...], list[Bench]] = defaultdict(list)
    for bench in benches:
        grouped[bench.line].append(bench)
    out = []
    for key in sorted(grouped):
        group = sorted(grouped[key], key=lambda b: (b.path != BASELINE_PATH, b.path, b.name))
        op, dtype, shape, direction, device = key
        baseline = next((b for b in group if b.path == BASELINE_PATH), None)
        emulated = any(b.emulated for b in group)
        rows = []
        for bench in group:
            if emulated:
                ratio, flag = None, NOT_COMPARED_EMULATED
            elif bench is baseline:
                ratio, flag = 1.0, BASELINE_FLAG
            elif baseline is None:
                ratio, flag = None, NO_BASELINE
            else:
                ratio, flag = bench.median / baseline.median, speed_flag(bench, baseline)
            rows.append(
                {
                    "path": bench.path,
                    "name": bench.name,
                    "median": bench.median,
                    "q1": bench.q1,
                    "q3": bench.q3,
                    "rounds": bench.rounds,
                    "median_text": number(bench.median),
                    "spread_text": f"{number(bench.q1)} - {number(bench.q3)}",
                    "ratio": number(ratio, 3),
                    "flag": flag,
                    "patch_id": bench.patch_id,
                    "memory": number(bench.peak_memory_bytes),
                }
            )
        out.append(
            {
                "label": f"{op} {dtype} {shape} {direction}".replace(" -", ""),
                "op": op,
                "dtype": dtype,
                "shape": shape,
                "direction": direction,
                "device": device_label(device, emulated),
                "emulated": emulated,
                "rows": rows,
            }
        )
    return out


def charts_by_device(bench_lines: list[dict[str, Any]]) -> list[str]:
    """One bar chart per real (non-emulated) device: emulated speed is never put beside others."""
    by_device: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in bench_lines:
        if not line["emulated"]:
            by_device[line["device"]["name"]].append(line)
    return [
        charts.benchmark_bars(f"benchmarks on {device}", group, f"bench-{i}")
        for i, (device, group) in enumerate(sorted(by_device.items()))
    ]


BASELINE_FLAG = "baseline"


def flag_counts(bench_lines: list[dict[str, Any]]) -> dict[str, int]:
    """How many paths were flagged each way (the baseline rows themselves are not counted)."""
    counts: dict[str, int] = defaultdict(int)
    for line in bench_lines:
        for row in line["rows"]:
            if row["flag"] != BASELINE_FLAG:
                counts[row["flag"]] += 1
    return dict(counts)
