"""Parity records: JSON round trip, atomic writes, permissions, validation, summary."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import types

import megatron_npu.parity.provenance as provenance_module
import megatron_npu.parity.summary as summary
import pytest
import torch
from megatron_npu.parity.metrics import compare
from megatron_npu.parity.provenance import (
    Git,
    Provenance,
    collect_provenance,
    detect_device,
    git_info,
)
from megatron_npu.parity.results import (
    ParityRecord,
    build_record,
    failed_record,
    read_records,
    record_filename,
    write_record,
)
from megatron_npu.parity.summary import print_summary, summary_table
from megatron_npu.parity.verdict import Tolerance

from megatron_npu import files
from megatron_npu.formats import FormatError

PAR = {"tp": 2, "pp": 1, "dp": 1, "cp": 1, "world": 2}

TOP_KEYS = {
    "schema_version",
    "patch_id",
    "target",
    "case",
    "dtype",
    "parallel",
    "device",
    "tensors",
    "verdict",
    "tolerance",
    "provenance",
    "kernels",
    "npu_kernel_exercised",
    "benchmark",
}
PROVENANCE_KEYS = {
    "device",
    "device_name",
    "python",
    "torch",
    "torch_npu",
    "megatron_core",
    "megatron_npu",
    "hypothesis",
    "git",
    "seed",
    "hostname",
    "timestamp_utc",
    "wall_time_s",
}


def provenance(device: str = "cpu", torch_npu: str | None = None) -> Provenance:
    return Provenance(
        device=device,
        python="3.11.7",
        torch="2.13.0+cpu",
        torch_npu=torch_npu,
        megatron_core="0.16.1",
        hypothesis="6.170.17",
        git=Git(commit="abc1234", dirty=True),
        seed=1234,
        hostname="host",
        timestamp_utc="2025-01-01T00:00:00.000000Z",
        wall_time_s=0.25,
        device_name=None,
    )


def make_record(
    patch: str = "rms_norm",
    case: str = "basic",
    dtype: str = "bfloat16",
    device: str = "cpu",
    bad: bool = False,
    tolerance: Tolerance | None = None,
) -> ParityRecord:
    tdt = getattr(torch, dtype)
    ref_dt = torch.float64 if tdt is torch.float32 else torch.float32
    good = compare(torch.tensor([1.0, 2.0], dtype=tdt), torch.tensor([1.0, 2.0], dtype=ref_dt), tdt)
    comps = {"out": good}
    if bad:
        comps["rstd"] = compare(
            torch.tensor([1.0, -2.0], dtype=tdt), torch.tensor([1.0, 2.0], dtype=ref_dt), tdt
        )
    return build_record(
        patch_id=patch,
        target="megatron.core.models.common.RMSNorm.forward",
        case=case,
        dtype=dtype,
        parallel=PAR,
        comparisons=comps,
        provenance=provenance(device),
        tolerance=tolerance,
    )


# --------------------------------------------------------------------------- record


def test_round_trip_with_tolerance(tmp_path):
    tol = Tolerance(cosine=0.98, reason="saturated softmax")
    rec = make_record(tolerance=tol, bad=True)
    path = write_record(rec, tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == TOP_KEYS
    assert set(data["provenance"]) == PROVENANCE_KEYS
    assert data["parallel"] == PAR
    assert data["tolerance"]["reason"] == "saturated softmax"
    assert set(data["tensors"]) == {"out", "rstd"}
    assert set(data["tensors"]["out"]) == {"metrics", "verdict"}
    assert [r.to_json() for r in read_records(tmp_path)] == [rec.to_json()]


def test_overall_verdict_is_the_worst_tensor():
    rec = make_record(bad=True)
    assert rec.tensors["out"].verdict.status == "pass"
    assert rec.tensors["rstd"].verdict.status == "error"  # cosine -0.6 <= 0.99
    assert rec.verdict.status == "error"
    assert rec.verdict.reason.startswith("rstd: cosine -0.6 <= 0.99")
    data = rec.to_data()
    data["verdict"] = {"status": "pass", "reason": "all good", "rule": "max_abs", "override": False}
    with pytest.raises(FormatError, match="verdict.status: .*worst tensor verdict"):
        ParityRecord.parse(data)


def _changed(rec: ParityRecord, **change) -> ParityRecord:
    """``rec`` with some top-level keys replaced, validated as a record read from a file."""
    return ParityRecord.parse({**rec.to_data(), **change})


@pytest.mark.parametrize(
    "change",
    [
        {"parallel": {"tp": 1, "pp": 1, "dp": 1}},
        {"parallel": {"tp": 0, "pp": 1, "dp": 1, "cp": 1, "world": 1}},
        {"device": "gpu"},
        {"dtype": "float64"},
        {"case": ""},
        {"tensors": {}},
    ],
)
def test_record_validation(change):
    rec = make_record()
    with pytest.raises(FormatError, match=rf"^<data>: {next(iter(change))}[.:]"):
        _changed(rec, **change)


def test_npu_label_needs_torch_npu():
    rec = make_record()
    without = provenance("npu", torch_npu=None).model_dump()
    with pytest.raises(FormatError, match="provenance.torch_npu: .*npu-emulated"):
        _changed(rec, device="npu", provenance=without)
    with_npu = provenance("npu", torch_npu="2.13.0").model_dump()
    ok = _changed(rec, device="npu", provenance=with_npu)
    assert ok.device == "npu"
    with pytest.raises(FormatError, match="provenance.device"):
        _changed(rec, device="npu-emulated")


@pytest.fixture
def emulation_active():
    from megatron_npu.ops import kernels

    previous = kernels.npu_kernels()
    from megatron_npu.testing import torch_npu_emulation

    kernels.use_npu_kernels(torch_npu_emulation)
    yield
    kernels.use_npu_kernels(previous)


def test_emulated_run_is_never_labelled_npu(emulation_active):
    assert detect_device() == "npu-emulated"
    with pytest.raises(ValueError, match="npu-emulated"):
        collect_provenance("npu", seed=0, wall_time_s=0.0)
    assert collect_provenance("npu-emulated", seed=0, wall_time_s=0.0).device == "npu-emulated"


def test_emulation_standing_in_as_torch_npu_is_not_torch_npu(monkeypatch):
    # the device layer installs the emulation as sys.modules["torch_npu"] when none is installed
    from megatron_npu.testing import torch_npu_emulation

    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu_emulation)
    monkeypatch.setattr(torch_npu_emulation, "__version__", "9.9.9", raising=False)
    assert detect_device() == "npu-emulated"
    with pytest.raises(ValueError, match="npu-emulated"):
        collect_provenance("npu", seed=0, wall_time_s=0.0)
    if provenance_module._package_version("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed")
    assert collect_provenance("npu-emulated", seed=0, wall_time_s=0.0).torch_npu is None


def test_active_adaptor_device_decides_the_label(monkeypatch):
    fake = types.SimpleNamespace(name="npu", emulated=True)
    monkeypatch.setattr(provenance_module, "_active_adaptor_device", lambda: fake)
    assert detect_device() == "npu-emulated"
    fake = types.SimpleNamespace(name="cuda", emulated=False)
    monkeypatch.setattr(provenance_module, "_active_adaptor_device", lambda: fake)
    assert detect_device() == "cuda"


def test_collect_provenance(tmp_path):
    prov = collect_provenance("cpu", seed=7, wall_time_s=1.5, repo_dir=tmp_path)
    assert (prov.device, prov.seed, prov.wall_time_s) == ("cpu", 7, 1.5)
    assert prov.torch == torch.__version__
    assert prov.timestamp_utc.endswith("Z")
    with pytest.raises(ValueError, match="device must be one of"):
        collect_provenance("ascend", seed=0, wall_time_s=0.0)


def test_git_info_never_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_info(tmp_path) is None  # not a repository

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance_module.subprocess, "run", no_git)
    assert git_info() is None


def test_git_info_never_takes_the_index_lock(monkeypatch):
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="", stderr="")

    monkeypatch.setattr(provenance_module.subprocess, "run", fake_run)
    git_info()
    assert calls and all(argv[:2] == ["git", "--no-optional-locks"] for argv in calls)


def test_git_info_dirty_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    try:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not available")
    info = git_info(tmp_path)
    assert info == Git(commit=None, dirty=False)  # no commits yet, nothing changed
    (tmp_path / "new.txt").write_text("x")
    assert git_info(tmp_path) == Git(commit=None, dirty=True)


# --------------------------------------------------------------------------- files


def test_filename_is_deterministic_and_safe():
    name = record_filename("a/b c", "../../etc", "float16", PAR, "npu-emulated")
    assert name == record_filename("a/b c", "../../etc", "float16", PAR, "npu-emulated")
    assert "/" not in name and " " not in name and not name.startswith(".")
    assert name.endswith(".json")
    assert "npu-emulated" in name and "tp2-pp1-dp1-cp1-world2" in name
    # keys that sanitize alike still get different files
    assert record_filename("a/b", "c", "float16", PAR, "cpu") != record_filename(
        "a_b", "c", "float16", PAR, "cpu"
    )
    other = dict(PAR, dp=2)
    assert record_filename("a", "c", "float16", PAR, "cpu") != record_filename(
        "a", "c", "float16", other, "cpu"
    )
    assert len(record_filename("p" * 500, "c" * 500, "float16", PAR, "cpu")) < 255


def test_permissions(tmp_path):
    old = os.umask(0o000)  # the modes must not depend on the umask
    try:
        path = write_record(make_record(), tmp_path / "new" / "results")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
    old = os.umask(0o077)
    try:
        path = write_record(make_record(case="other"), tmp_path / "new" / "results")
        other = write_record(make_record(), tmp_path / "strict")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(other.stat().st_mode) == 0o640
    assert stat.S_IMODE(other.parent.stat().st_mode) == 0o750


def test_rewrite_replaces_and_leaves_no_temp_file(tmp_path):
    first = write_record(make_record(), tmp_path)
    second = write_record(make_record(bad=True), tmp_path)
    assert first == second
    assert os.listdir(tmp_path) == [first.name]
    assert read_records(tmp_path)[0].verdict.status == "error"


def _disk_full(fd):
    raise OSError("disk full")  # the temp file holds what was written so far


def _fail_replace(src, dst):
    raise OSError("replace failed")


@pytest.mark.parametrize(("target", "fake"), [("fsync", _disk_full), ("replace", _fail_replace)])
def test_failed_write_keeps_old_file_and_no_temp(tmp_path, monkeypatch, target, fake):
    path = write_record(make_record(), tmp_path)
    before = path.read_bytes()
    monkeypatch.setattr(files.os, target, fake)
    with pytest.raises(OSError):
        write_record(make_record(bad=True), tmp_path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [path.name]
    assert path.read_bytes() == before
    assert read_records(tmp_path)[0].verdict.status == "pass"


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(files.os, "fsync", _disk_full)
    with pytest.raises(OSError):
        write_record(make_record(), tmp_path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- reading


def _write_raw(tmp_path, mutate):
    path = write_record(make_record(), tmp_path)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda d: d["provenance"].pop("seed"), "provenance.seed"),
        (lambda d: d.pop("tensors"), "tensors"),
        (lambda d: d["tensors"]["out"]["metrics"].pop("cosine"), "tensors.out.metrics.cosine"),
        (lambda d: d["tensors"]["out"].pop("verdict"), "tensors.out.verdict"),
        (lambda d: d["verdict"].pop("status"), "verdict.status"),
        (lambda d: d["parallel"].pop("world"), "parallel.world"),
        (lambda d: d["provenance"]["git"].pop("dirty"), "provenance.git.dirty"),
        (lambda d: d.update(schema_version=4), "schema_version"),
        (lambda d: d["parallel"].pop("cp"), "parallel.cp"),
        (lambda d: d.update(kernels={"npu_swiglu": "2"}), "kernels.npu_swiglu"),
        (lambda d: d.update(npu_kernel_exercised="yes"), "npu_kernel_exercised"),
        (lambda d: d.pop("benchmark"), "benchmark"),
        (
            lambda d: d.update(parallel={"tp": "2", "pp": 1, "dp": 1, "cp": 1, "world": 2}),
            "parallel.tp",
        ),
        (lambda d: d["provenance"].update(seed=True), "provenance.seed"),
        (lambda d: d.update(device="npu-ish"), "device"),
    ],
)
def test_read_errors_name_file_and_key(tmp_path, mutate, key):
    path = _write_raw(tmp_path, mutate)
    with pytest.raises(FormatError) as info:
        read_records(tmp_path)
    assert str(info.value).startswith(f"{path}: {key}: ")


def test_read_rejects_npu_label_without_torch_npu(tmp_path):
    def to_npu(d):
        d["device"] = "npu"
        d["provenance"]["device"] = "npu"

    path = _write_raw(tmp_path, to_npu)
    with pytest.raises(FormatError, match="npu-emulated") as info:
        read_records(tmp_path)
    assert str(info.value).startswith(f"{path}: provenance.torch_npu: ")


def test_read_invalid_json_names_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(FormatError, match=r"broken.json: is not JSON"):
        read_records(tmp_path)


def test_read_skips_temp_files_and_missing_dir(tmp_path):
    write_record(make_record(), tmp_path)
    (tmp_path / ".x.json.abc.tmp").write_text("{partial")
    (tmp_path / ".hidden.json").write_text("{partial")
    assert len(read_records(tmp_path)) == 1
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "missing")


def test_non_finite_metrics_stay_strict_json(tmp_path):
    rec = make_record()
    rec.tensors["out"].metrics.max_rel_error = float("inf")
    path = write_record(rec, tmp_path)
    assert '"Infinity"' in path.read_text()
    assert read_records(tmp_path)[0].tensors["out"].metrics.max_rel_error == float("inf")


# --------------------------------------------------------------------------- summary


def test_summary_table_rows():
    recs = [
        make_record(patch="swiglu", dtype="float16"),
        make_record(patch="rms_norm", bad=True),
    ]
    rows = summary_table(recs)
    assert [r.patch for r in rows] == ["rms_norm", "swiglu"]  # sorted
    first = rows[0]
    assert (first.dtype, first.parallel, first.device, first.verdict) == (
        "bfloat16",
        "tp2 pp1 dp1 w2",
        "cpu",
        "error",
    )
    assert first.worst_metric.startswith("rstd: cosine")
    assert rows[1].verdict == "pass"
    assert rows[1].worst_metric.startswith("out: max abs error 0 < 0.001")


def test_print_summary():
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, color_system=None)
    print_summary([make_record(bad=True)], console=console)
    text = console.file.getvalue()
    assert "rms_norm" in text and "error" in text and "tp2 pp1 dp1 w2" in text


def test_documented_example_is_a_valid_record():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "parity-results.md").read_text()
    example = doc.split("## Example record", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    data = json.loads(example)
    rec = ParityRecord.parse(data)
    assert rec.to_json() == json.dumps(data, indent=2, sort_keys=True) + "\n"
    # every metric key is documented in the metrics table
    for key in next(iter(rec.tensors.values())).metrics.model_dump():
        assert f"`{key}`" in doc, key


# --------------------------------------------------------------------------- schema 2


def _bench(dtype: str = "bfloat16", scale: float = 1.0):
    from megatron_npu.parity.benchmark import benchmark_result

    tdt = getattr(torch, dtype)
    ref = torch.linspace(-2, 2, 64, dtype=torch.float32)
    tested = compare((ref * scale).to(tdt), ref, tdt)
    bench = compare(ref.to(tdt), ref, tdt)
    return tested, benchmark_result(tested, bench, "L0")


def test_schema_2_record_with_kernels_and_benchmark_round_trips(tmp_path):
    tested, bres = _bench()
    rec = build_record(
        patch_id="p",
        target="m.f",
        case="c",
        dtype="bfloat16",
        parallel=PAR,
        comparisons={"out": tested},
        benchmarks={"out": bres},
        benchmark_level="L0",
        kernels={"npu_rms_norm": 3},
        provenance=provenance("npu-emulated"),
    )
    assert rec.schema_version == 3
    assert (rec.kernels, rec.npu_kernel_exercised) == ({"npu_rms_norm": 3}, True)
    assert rec.tensors["out"].verdict.rule == "benchmark"
    assert rec.benchmark is not None and rec.benchmark.tensors["out"].verdict.status == "pass"
    path = write_record(rec, tmp_path)
    (back,) = read_records(tmp_path)
    assert back.to_json() == rec.to_json() and back.source == str(path)
    assert summary_table([back])[0].npu_code == summary.KERNEL_EXERCISED


def test_benchmark_error_decides_a_bf16_tensor_that_stage_1_passes():
    tested, bres = _bench(scale=1.03)  # 3 % off everywhere: a bf16-only bug
    assert bres.status == "error" and "mean_rel_error" in bres.reason
    rec = build_record(
        patch_id="p",
        target="m.f",
        case="c",
        dtype="bfloat16",
        parallel=PAR,
        comparisons={"out": tested},
        benchmarks={"out": bres},
        provenance=provenance(),
    )
    assert (rec.verdict.status, rec.verdict.rule) == ("error", "benchmark")


def test_schema_1_records_are_still_read(tmp_path):
    def to_v1(d):
        d["schema_version"] = 1
        for key in ("kernels", "npu_kernel_exercised", "benchmark"):
            d.pop(key)
        for t in d["tensors"].values():
            for key in ("rel_l2", "rel_l2_bound", "small_value_atol", "rel_l2_benchmark"):
                t["metrics"].pop(key)

    _write_raw(tmp_path, to_v1)
    (rec,) = read_records(tmp_path)
    assert rec.schema_version == 1
    assert (rec.kernels, rec.npu_kernel_exercised, rec.benchmark) == (None, None, None)
    assert rec.tensors["out"].metrics.rel_l2 is None
    assert summary.npu_code(rec.model_copy(update={"device": "cpu"})) == "-"


def test_crashed_cell_is_an_error_record_without_tensors(tmp_path):
    rec = failed_record(
        patch_id="p",
        target="m.f",
        case="c",
        dtype="float32",
        parallel=PAR,
        provenance=provenance("npu-emulated"),
        rule="crash",
        reason="RuntimeError: boom",
    )
    assert (rec.verdict.status, rec.verdict.rule, rec.tensors) == ("error", "crash", {})
    path = write_record(rec, tmp_path)
    (back,) = read_records(tmp_path)
    assert back.to_json() == rec.to_json() and back.source == str(path)
    lines = summary.summary_lines([back, make_record()])
    assert lines[0] == "2 records: 1 error, 1 pass"
    assert "cells that failed before comparing: 1 crash" in lines
    assert "npu-emulated cells: 0 exercised an NPU kernel, 1 ran the same code as cpu" in lines


def test_only_failure_rules_may_have_no_tensors():
    with pytest.raises(FormatError, match="tensors: .*at least one compared tensor"):
        _changed(make_record(), tensors={})
    with pytest.raises(FormatError, match="npu_kernel_exercised: "):
        _changed(make_record(), kernels={"npu_swiglu": 1})


def test_a_schema_2_record_has_no_cp_and_reads_as_cp_1(tmp_path):
    _write_raw(tmp_path, lambda d: (d.update(schema_version=2), d["parallel"].pop("cp")))
    (record,) = read_records(tmp_path)
    assert record.parallel.cp == 1 and record.schema_version == 2
