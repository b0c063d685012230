"""The report's sections, computed from the records and the registry."""

from __future__ import annotations

import importlib.metadata

import pytest
import report_fixtures as fx
from megatron_npu.parity.results import read_records
from megatron_npu.reports.bench_view import NOT_COMPARED_EMULATED
from megatron_npu.reports.build import context
from megatron_npu.reports.inputs import load

from megatron_npu.registry import all_patches


@pytest.fixture(scope="module")
def ctx(parity_runs, compare_dir, bench_file, info_file):
    return context(load([parity_runs["base"], compare_dir, bench_file, info_file]))


def test_matrix_has_one_row_per_record(ctx, parity_runs):
    expected = {
        (r.patch_id, r.case, r.dtype, r.device, r.verdict.status)
        for r in read_records(parity_runs["base"])  # the harness's own reader
    }
    rows = {
        (r["patch"], r["case"], r["dtype"], r["device"]["name"], r["status"])
        for r in ctx["parity_rows"]
    }
    assert rows == expected
    assert ctx["parity_filters"]["device"] == sorted(fx.PARITY_DEVICES)


def test_every_cell_opens_to_metrics_tolerance_and_reason(ctx):
    for row in ctx["parity_rows"]:
        assert row["tensors"] and row["reason"]
        for tensor in row["tensors"]:
            assert dict(tensor["metrics"])["cosine"] != "-"
        assert row["tolerance"] or row["default_tolerance"]["cosine"] == 0.99


def test_coverage_lists_every_registry_patch(ctx):
    rows = {r["patch"]: r for r in ctx["coverage"]}
    patches = all_patches()
    assert set(rows) == {p.id for p in patches}
    for patch in patches:
        row = rows[patch.id]
        assert (row["case"] is not None) == bool(patch.parity)
        assert row["exemption"] == (patch.parity_exempt or None)
    swiglu = rows[fx.PARITY_PATCH]
    assert swiglu["records"] == len(fx.PARITY_DEVICES) * len(fx.PARITY_DTYPES)
    # the quick matrix has this patch in float16 too, which the fixture did not run
    assert any("float16" in m for m in swiglu["missing"])


def test_emulated_devices_are_labelled_and_never_merged(ctx):
    parity = next(row for row in ctx["banner"] if row["kind"] == "parity cells")
    assert {d["name"]: d["emulated"] for d in parity["devices"]} == {
        "cpu": False,
        "npu-emulated": True,
    }
    runs = next(row for row in ctx["banner"] if row["kind"] == "training runs")
    assert {d["name"]: d["emulated"] for d in runs["devices"]} == {
        device: emulated for _, device, emulated in fx.RUNS
    }


def _bench_rows(context_: dict) -> dict:
    return {
        (line["op"], line["device"]["name"], r["path"]): r
        for line in context_["bench_lines"]
        for r in line["rows"]
    }


def test_benchmark_ratios_are_the_real_medians(ctx, bench_file):
    rows = _bench_rows(ctx)
    medians = {
        (b["extra_info"]["op"], b["extra_info"]["device"], b["extra_info"]["path"]): b["stats"][
            "median"
        ]
        for b in fx.benchmarks(bench_file)
    }
    for op in ("bias-swiglu", "bias-gelu"):
        native, megatron = medians[(op, "cpu", "native")], medians[(op, "cpu", "megatron")]
        assert rows[(op, "cpu", "native")]["ratio"] == f"{native / megatron:.3g}"
        assert rows[(op, "cpu", "megatron")]["flag"] == "baseline"
        emulated = rows[(op, "npu-emulated", "npu-binding")]
        assert emulated["flag"] == NOT_COMPARED_EMULATED and emulated["ratio"] == "-"
    assert len(ctx["bench_charts"]) == 1  # cpu only: emulated timings are not charted


def test_benchmark_flags_need_separated_spreads(bench_file, tmp_path):
    """Real records with the native path moved to a known multiple of its line's Megatron
    timings: far enough that the spreads separate, whatever the machine's noise was."""
    stats = {
        b["extra_info"]["op"]: b["stats"]
        for b in fx.benchmarks(bench_file)
        if b["extra_info"]["path"] == "megatron"
    }
    slow = 2 * stats["bias-swiglu"]["q3"] / stats["bias-swiglu"]["q1"]
    fast = stats["bias-gelu"]["q1"] / stats["bias-gelu"]["q3"] / 2
    known = fx.with_paths_relative(
        bench_file,
        tmp_path / "b.json",
        {("bias-swiglu", "native"): slow, ("bias-gelu", "native"): fast},
    )
    rows = _bench_rows(context(load([known])))
    assert rows[("bias-swiglu", "cpu", "native")]["ratio"] == f"{slow:.3g}"
    assert rows[("bias-swiglu", "cpu", "native")]["flag"] == "slower"
    assert rows[("bias-gelu", "cpu", "native")]["ratio"] == f"{fast:.3g}"
    assert rows[("bias-gelu", "cpu", "native")]["flag"] == "faster"
    same = fx.with_paths_relative(
        bench_file, tmp_path / "same.json", {("bias-gelu", "native"): 1.0}
    )
    assert _bench_rows(context(load([same])))[("bias-gelu", "cpu", "native")]["flag"] == "same"


def test_loss_curves_table2_and_verdicts(ctx, compare_dir):
    import json

    from megatron_npu.compare import table2 as compare_table
    from megatron_npu.compare.rules import mfu_shown

    [comp] = ctx["comparisons"]
    assert comp["run_names"] == [r[0] for r in fx.RUNS]
    for name, device, _ in fx.RUNS:  # one trace each; the browser test counts them on the page
        assert f'"name":"{name} ({device})' in comp["loss_div"]
    for name, device, _ in fx.RUNS:  # every run's grad norms in one chart
        assert f'"name":"{name} ({device})' in comp["grad_div"]
    # the verdict matrix: one row per pair, one cell per rule, each the verdict compare wrote
    results = json.loads((compare_dir / "results.json").read_text())
    matrix = comp["verdict_matrix"]
    assert set(matrix["rules"]) == {v["rule"] for v in results["verdicts"]}
    cells = {
        (r["candidate"], r["baseline"], rule): cell
        for r in matrix["rows"]
        for rule, cell in r["cells"].items()
    }
    assert len(cells) == len(results["verdicts"])
    for v in results["verdicts"]:
        cell = cells[(v["candidate"], v["baseline"], v["rule"])]
        assert (cell["status"], cell["detail"]) == (v["status"], v["detail"])
    # one overlay per curve rule: every judged pair a trace, the rule's band shaded
    curve = [v for v in results["verdicts"] if (v.get("per_step") or {}).get("iteration")]
    overlays = {o["rule"]: o for o in comp["overlays"]}
    assert set(overlays) == {v["rule"] for v in curve} == {"layout", "approximate"}
    for v in curve:
        assert f'"name":"{v["candidate"]} vs {v["baseline"]}"' in overlays[v["rule"]]["plot"]
    assert {o["band"] for o in overlays.values()} == {1e-5, 0.02}
    table = comp["table2"]
    # compare's own column labels, with units, in compare's order
    assert [table["labels"][k] for k in table["columns"]] == [
        label for key, label in compare_table.labels([]) if key in table["columns"]
    ]
    assert "emulated" not in table["columns"] and table["labels"]["mfu"] == "MFU % [95% CI]"
    assert table["labels"]["s_per_step"] == "s/step [95% CI]"
    assert [row["device"]["emulated"] for row in table["rows"]] == [r[2] for r in fx.RUNS]
    # every cell is what compare's table2.md shows for that run
    written = (compare_dir / "table2.md").read_text()
    for row, cells in zip(results["table2"], table["rows"], strict=True):
        shown = [cells[k]["text"] for k in table["columns"] if k != "device"]
        line = next(x for x in written.splitlines() if x.startswith(f"| {row['name']} |"))
        assert all(f"| {text} |" in line for text in shown), (line, shown)
    # the emulated-row rule is the product's: MFU only where compare's rule shows one
    for row, cells, (_, _, emulated) in zip(results["table2"], table["rows"], fx.RUNS, strict=True):
        assert row["emulated"] is emulated
        assert (row["mfu"] is not None) == mfu_shown(emulated)
        assert (cells["mfu"]["text"] == "n/a (emulated)") == emulated
        if not emulated:  # MFU in %, with the interval the s/step interval gives
            assert cells["mfu"]["text"].startswith(f"{100 * row['mfu']:.2f} [")


def test_headline_says_which_rule_failed_for_which_run(compare_dir, tmp_path):
    import json

    from megatron_npu.reports.compare_view import headline

    assert headline(load([compare_dir]).comparisons)["text"].startswith("Comparison passed")
    data = json.loads((compare_dir / "results.json").read_text())
    verdict = next(v for v in data["verdicts"] if v["rule"] == "approximate")
    verdict["status"] = "fail"
    folder = tmp_path / "failed"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(data))
    line = headline(load([folder]).comparisons)
    assert not line["passed"]
    assert line["text"] == (
        f"Comparison FAILED: approximate fail for {verdict['candidate']} vs {verdict['baseline']}."
    )


def test_provenance_has_commands_seeds_and_versions(ctx):
    [cmp] = ctx["provenance"]["compare"]
    assert " -m megatron_npu.cli train " in cmp["runs"][0]["command"]
    assert cmp["runs"][0]["seed"] == 1234
    [parity] = [p for p in ctx["provenance"]["parity"] if p["device"]["name"] == "cpu"]
    assert parity["seeds"] == "7" and parity["fields"]["torch"].startswith("2.")
    # the release that chose the examples
    assert parity["fields"]["hypothesis"] == importlib.metadata.version("hypothesis")


def test_a_failed_run_keeps_its_trace_and_error(compare_dir, tmp_path):
    import json

    from megatron_npu.reports.compare_view import comparison_section

    folder = fx.copy_results(compare_dir, tmp_path / "cmp")
    data = json.loads((folder / "results.json").read_text())
    data["runs"][1].update(status="failed", error="rank 1 exited with code 1", steps=[])
    (folder / "results.json").write_text(json.dumps(data))
    [comp] = load([folder]).comparisons
    section = comparison_section(comp, 0)
    assert section["run_count"] == len(fx.RUNS)
    assert f"{fx.RUNS[1][0]} ({fx.RUNS[1][1]}) - no steps (failed)" in section["loss_div"]
    assert section["failed_runs"] == [
        {"name": fx.RUNS[1][0], "status": "failed", "error": "rank 1 exited with code 1"}
    ]


def test_page_is_self_contained(parity_runs, compare_dir, bench_file, tmp_path):
    import re

    from megatron_npu.reports import build_report

    html = build_report([parity_runs["base"], compare_dir, bench_file], tmp_path / "r.html")
    text = html.read_text()
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=", text)
    assert not re.search(r"<link\b", text)
    assert "Content-Security-Policy" in text and "default-src 'none'" in text


def test_compare_extras_and_a_run_without_device(compare_dir, tmp_path):
    import json

    from megatron_npu.reports.compare_view import band, comparison_section

    folder = fx.copy_results(compare_dir, tmp_path / "cmp")
    data = json.loads((folder / "results.json").read_text())
    data["skipped"] = [
        {"name": "cuda-fp32", "reason": "none of its devices (cuda) is available here"}
    ]
    data["notes"] = ["vocabulary padding aligned to a multiple of 256"]
    data["runs"][2].update(
        device=None,
        emulated=False,
        status="failed",
        steps=[],
        perf=None,
        error="no device of its list is available",
    )
    (folder / "results.json").write_text(json.dumps(data))
    rs = load([folder])
    assert rs.skipped == []
    section = comparison_section(rs.comparisons[0], 0)
    assert [s.model_dump() for s in section["not_run"]] == data["skipped"]
    assert section["notes"] == data["notes"]
    runs = next(row for row in context(rs)["banner"] if row["kind"] == "training runs")
    assert [d["name"] for d in runs["devices"]] == ["cpu"]
    assert band({"per_step_rel": 1e-5}) == 1e-5
    assert band({"losses": "bitwise", "grad_norms": "bitwise"}) == 0.0
    assert band({"threshold": 0.1, "ci": 0.95}) is None


def test_status_phrases_take_their_most_severe_word():
    from megatron_npu.reports.formatting import status_class

    assert status_class("pass approximate vs ref") == "pass"
    assert status_class("pass approximate vs ref; SLOWER") == "error"
    assert status_class("FAIL layout vs emu") == "error"
    assert status_class("REFUSED (fingerprint)") == "warning"
    assert status_class("baseline") == "neutral"
