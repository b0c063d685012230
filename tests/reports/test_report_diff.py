"""Diff mode: two result sets give exactly what changed."""

from __future__ import annotations

import report_fixtures as fx
from megatron_npu.reports import build_report
from megatron_npu.reports.diff import diff
from megatron_npu.reports.inputs import load


def _cells(rows):
    return [r["key"] for r in rows]


def test_planted_regression_is_exactly_that_cell(parity_runs):
    base, planted = load([parity_runs["base"]]), load([parity_runs["planted"]])
    [cell] = [c for c in planted.parity if (c.device, c.dtype) == fx.PLANTED_CELL]
    assert cell.verdict.status == "error"
    d = diff(base, planted)["parity"]
    assert _cells(d["new_errors"]) == ["|".join(cell.key)]
    assert d["fixed"] == d["other_changes"] == d["appeared"] == d["disappeared"] == []
    assert d["metric_shifts"] and {s["cell"] for s in d["metric_shifts"]} == {cell.label}


def test_the_fix_is_reported_the_other_way_round(parity_runs):
    d = diff(load([parity_runs["planted"]]), load([parity_runs["base"]]))["parity"]
    assert len(d["fixed"]) == 1 and d["new_errors"] == []


def test_identical_sets_show_nothing(parity_runs, compare_dir, bench_file):
    rs = load([parity_runs["base"], compare_dir, bench_file])
    assert diff(rs, rs)["total"] == 0


def test_speed_changes_skip_emulated(tmp_path, compare_dir, bench_file):
    # a slowdown the runs' own spreads cannot hide: at least 10x, and twice the widest spread (a
    # loaded machine has given cpu-tp2 a 95 % interval, and a benchmark an interquartile range,
    # over 10x wide)
    lo, hi = fx.s_per_step_interval(compare_dir, "cpu-tp2")
    slower_cmp = fx.copy_results(compare_dir, tmp_path / "default", slower=max(10.0, 2 * hi / lo))
    real = [b for b in fx.benchmarks(bench_file) if not b["extra_info"]["emulated"]]
    assert len(real) == 4
    spread = max(b["stats"]["q3"] / b["stats"]["q1"] for b in real)
    slower_bench = fx.scaled_benchmarks(bench_file, tmp_path / "b.json", max(10.0, 2 * spread))
    d = diff(load([compare_dir, bench_file]), load([slower_cmp, slower_bench]))
    flagged = {row["what"] for row in d["speed_changes"]}
    assert len(flagged) == 1 + len(real)  # cpu-tp2's s/step and every non-emulated benchmark
    assert all(row["flag"] == "slower" for row in d["speed_changes"])
    assert not any("emu" in w or "npu-emulated" in w for w in flagged)


def test_diff_page_shows_the_planted_cell(parity_runs, tmp_path):
    out = build_report(
        [parity_runs["planted"]], tmp_path / "d.html", diff_base=[parity_runs["base"]]
    )
    html = out.read_text()
    new_errors = html.split('id="diff-new_errors"')[1].split("</table>")[0]
    assert new_errors.count("<tr data-key=") == 1
    assert f"{fx.PARITY_PATCH} [" in new_errors and "|cpu" in new_errors
