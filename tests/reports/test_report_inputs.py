"""Reading a report's inputs: kinds from content, and every bad or partial input named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import report_fixtures as fx
from megatron_npu.reports import ReportInputError, build_report
from megatron_npu.reports.build import context
from megatron_npu.reports.inputs import load

#: a schema-2 ``benchmark`` object as parity/results.py writes it
BENCHMARK_SECTION = {
    "path": "stock Megatron path in the same dtype",
    "level": "L0",
    "unavailable": None,
    "tensors": {
        "out": {
            "level": "L0",
            "tested": {"max_rel_error": 0.02},
            "benchmark": {"max_rel_error": 0.01},
            "ratios": {"max_rel_error": 2.0},
            "limits": {"max_rel_error": 10.0},
            "verdict": {"status": "pass", "reason": "every ratio within L0"},
        }
    },
}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _records(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


def test_kinds_are_read_from_content(parity_runs, compare_dir, bench_file, info_file):
    rs = load([parity_runs["base"], compare_dir, bench_file, info_file])
    assert rs.kinds() == ["parity", "compare", "benchmark", "info"]
    assert len(rs.parity) == len(fx.PARITY_DEVICES) * len(fx.PARITY_DTYPES)
    assert [r.name for r in rs.comparisons[0].runs] == [r[0] for r in fx.RUNS]
    assert len(rs.benches) == len(fx.benchmarks(bench_file)) == 6
    assert rs.skipped == []


def test_compare_results_file_and_single_record_are_accepted(parity_runs, compare_dir):
    rs = load([compare_dir / "results.json", _records(parity_runs["base"])[0]])
    assert len(rs.comparisons) == 1 and len(rs.parity) == 1 and rs.skipped == []


def test_truncated_record_is_skipped_and_named(parity_runs, tmp_path):
    folder = _copy(parity_runs["base"], tmp_path / "run")
    bad = _records(folder)[0]
    bad.write_text(bad.read_text()[:200])
    rs = load([folder])
    assert len(rs.parity) == len(_records(folder)) - 1
    [skip] = rs.skipped
    assert skip.source == str(bad) and skip.reason.startswith("is not JSON (")


def test_unknown_schema_version_is_named(parity_runs, tmp_path):
    folder = _copy(parity_runs["base"], tmp_path / "run")
    bad = _records(folder)[1]
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "schema_version": 99}))
    [skip] = load([folder]).skipped
    assert skip.reason == "schema_version: is not a version the readers know (1, 2 or 3) (got 99)"


def test_missing_key_is_named(parity_runs, tmp_path):
    folder = _copy(parity_runs["base"], tmp_path / "run")
    bad = _records(folder)[0]
    data = json.loads(bad.read_text())
    del data["parallel"]["tp"]
    bad.write_text(json.dumps(data))
    [skip] = load([folder]).skipped
    assert skip.reason == "parallel.tp: field required"


def test_schema_2_records_and_crash_records_are_read(parity_runs, tmp_path):
    folder = _copy(parity_runs["base"], tmp_path / "run")
    first, second = _records(folder)[:2]
    data = json.loads(first.read_text())
    data.update(
        schema_version=2,
        kernels={"npu_swiglu": 3},
        npu_kernel_exercised=True,
        benchmark=BENCHMARK_SECTION,
    )
    first.write_text(json.dumps(data))
    crash = json.loads(second.read_text())
    crash.update(
        schema_version=2,
        kernels={},
        npu_kernel_exercised=False,
        benchmark=None,
        tensors={},
        verdict={
            "status": "error",
            "rule": "crash",
            "override": False,
            "reason": "RuntimeError: boom",
        },
    )
    second.write_text(json.dumps(crash))
    rs = load([folder])
    assert rs.skipped == []
    cells = {c.source: c for c in rs.parity}
    assert cells[str(first)].kernels == {"npu_swiglu": 3}
    assert cells[str(first)].to_data()["benchmark"] == BENCHMARK_SECTION
    [row] = [r for r in context(rs)["parity_rows"] if r["source"] == str(first)]
    [tensor] = row["benchmark"]["tensors"]
    assert tensor["rows"][0] == ("max_rel_error", "0.02", "0.01", "2", "10")
    assert tensor["status"] == "pass"
    assert cells[str(second)].verdict.rule == "crash" and cells[str(second)].tensors == {}


def test_schema_2_needs_its_keys(parity_runs, tmp_path):
    folder = _copy(parity_runs["base"], tmp_path / "run")
    bad = _records(folder)[0]
    record = {**json.loads(bad.read_text()), "schema_version": 2}
    record.pop("kernels", None)  # the harness writes schema 2 now: drop one of its keys
    bad.write_text(json.dumps(record))
    [skip] = load([folder]).skipped
    assert skip.reason == "kernels: field required from schema 2"


def test_empty_folder_unreadable_and_unknown_files_are_listed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    rs = load([empty, binary, other])
    reasons = {Path(s.source).name: s.reason for s in rs.skipped}
    assert reasons["empty"].startswith("empty")
    assert reasons["binary.json"].startswith("unreadable")
    assert reasons["other.json"].startswith("not a parity record")


def test_bad_compare_results_is_named(compare_dir, tmp_path):
    folder = tmp_path / "cmp"
    shutil.copytree(compare_dir, folder)
    data = json.loads((folder / "results.json").read_text())
    del data["runs"][1]["device"]
    (folder / "results.json").write_text(json.dumps(data))
    [skip] = load([folder]).skipped
    assert "runs[1].device" in skip.reason


def test_benchmark_without_extra_info_is_shown(tmp_path, bench_file):
    path = tmp_path / "b.json"
    data = json.loads(bench_file.read_text())
    for bench in data["benchmarks"]:
        bench["extra_info"] = {}
    path.write_text(json.dumps(data))
    rs = load([path])
    groups = {bench["group"] for bench in fx.benchmarks(bench_file)}
    assert {b.op for b in rs.benches} == groups  # the group stands in
    assert {b.device for b in rs.benches} == {"unknown"}


def test_a_report_of_bad_inputs_says_what_was_skipped(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = build_report([empty], tmp_path / "r.html")
    html = out.read_text()
    assert 'id="skipped"' in html and str(empty) in html


def test_missing_path_is_a_named_error(tmp_path):
    with pytest.raises(ReportInputError, match="nowhere"):
        build_report([tmp_path / "nowhere"], tmp_path / "r.html")


def test_cli_names_a_missing_input_without_traceback(tmp_path, capsys):
    from megatron_npu.cli import main

    assert main(["report", str(tmp_path / "nowhere"), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "does not exist" in err and "Traceback" not in err
