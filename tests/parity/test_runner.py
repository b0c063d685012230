"""``megatron-npu parity`` runs the generated matrix through pytest and summarises the records."""

from __future__ import annotations

import subprocess
import sys

from megatron_npu.parity.case import Parallel
from megatron_npu.parity.results import read_records


def _run(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "parity", "--results", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )


def test_parity_cli_writes_records_and_a_summary(tmp_path):
    proc = _run(
        tmp_path,
        "--quick",
        "--device",
        "cpu",
        "--device",
        "npu-emulated",
        "-k",
        "data.build-sample-idx",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list(tmp_path.glob("run-*-quick"))
    assert len(runs) == 1
    records = read_records(runs[0])
    assert {r.device for r in records} == {"cpu", "npu-emulated"}
    assert all(r.patch_id == "data.build-sample-idx" for r in records)
    assert "2 records: 2 pass" in proc.stdout
    assert (
        "npu-emulated cells: 0 exercised an NPU kernel, 1 ran the same code as cpu" in proc.stdout
    )
    assert "parity results" in proc.stdout


def test_parity_cli_fails_when_nothing_ran(tmp_path):
    proc = _run(tmp_path, "--quick", "--device", "cpu", "-k", "no-such-patch")
    assert proc.returncode != 0
    assert "no records were written" in proc.stderr


# --------------------------------------------------------------------------- failing cells


def _plant_run(monkeypatch, run):
    import dataclasses
    import importlib

    from megatron_npu.registry import get_patch

    patch = get_patch("activation.bias-swiglu")
    module_name, _, attr = patch.parity.partition(":")
    module = importlib.import_module(module_name)
    case = getattr(module, attr)
    monkeypatch.setattr(module, attr, dataclasses.replace(case, run=run))
    return patch, case


def _job(patch, case):
    from megatron_npu.parity.harness import Job
    from megatron_npu.parity.matrix import case_examples

    return Job(
        patch.id, "npu-emulated", "float32", case.parallel[0], case_examples(case.name, "quick")[:1]
    )


def test_a_crashing_cell_is_an_error_record_counted_in_the_summary(monkeypatch, tmp_path):
    from megatron_npu.parity.harness import evaluate
    from megatron_npu.parity.results import write_record
    from megatron_npu.parity.summary import summary_lines

    def run(ctx, inputs):
        raise RuntimeError("kernel exploded")

    patch, case = _plant_run(monkeypatch, run)
    record = evaluate(_job(patch, case))
    assert (record.verdict.status, record.verdict.rule) == ("error", "crash")
    assert "RuntimeError: kernel exploded" in record.verdict.reason
    write_record(record, tmp_path)
    lines = summary_lines(read_records(tmp_path))
    assert lines[0] == "1 records: 1 error"
    assert "cells that failed before comparing: 1 crash" in lines


def test_a_hanging_cell_is_a_timeout_record(monkeypatch):
    import time

    from megatron_npu.parity.harness import evaluate

    def run(ctx, inputs):
        time.sleep(60)

    patch, case = _plant_run(monkeypatch, run)
    record = evaluate(_job(patch, case), timeout_s=1)
    assert (record.verdict.status, record.verdict.rule) == ("error", "timeout")
    assert "deadline" in record.verdict.reason


def test_kernels_are_counted_per_cell():
    from megatron_npu.parity.harness import Job, evaluate
    from megatron_npu.parity.matrix import case_examples

    from megatron_npu.registry import get_patch

    patch = get_patch("activation.bias-swiglu")
    examples = case_examples("bias-swiglu", "quick")[:1]
    emulated = evaluate(Job(patch.id, "npu-emulated", "float32", Parallel(), examples))
    cpu = evaluate(Job(patch.id, "cpu", "float32", Parallel(), examples))
    assert emulated.npu_kernel_exercised and emulated.kernels.get("npu_swiglu", 0) >= 1
    assert (cpu.npu_kernel_exercised, cpu.kernels) == (False, {})


def test_a_bf16_bug_stage1_only_warns_about_errors_on_the_benchmark(monkeypatch):
    """10 % off on every 500th output element: bf16's stage-1 rules give the same standing
    warning as for a clean cell (dual hundredth holds, dual thousandth fails either way) and the
    relative L2 error stays under bf16's floor; msprobe's stage-2 benchmark (the stock path in
    bf16 against the same reference) makes it an error, the clean cell a pass."""
    from megatron_npu.parity.harness import Job, evaluate
    from megatron_npu.parity.matrix import case_examples
    from megatron_npu.parity.verdict import verdict

    from megatron_npu.ops import swiglu as swiglu_op
    from megatron_npu.registry import get_patch

    patch = get_patch("activation.bias-swiglu")
    job = Job(patch.id, "cpu", "bfloat16", Parallel(), case_examples("bias-swiglu", "quick")[:1])
    clean = evaluate(job)
    original = swiglu_op.native_swiglu

    def buggy_swiglu(x, dim=-1):
        y = original(x, dim).clone()
        y.view(-1)[::500] *= 1.1
        return y

    monkeypatch.setattr(swiglu_op, "native_swiglu", buggy_swiglu)
    buggy = evaluate(job)
    assert (clean.verdict.status, clean.verdict.rule) == ("pass", "benchmark")
    out_clean, out_buggy = clean.tensors["out"], buggy.tensors["out"]
    assert (out_buggy.verdict.status, out_buggy.verdict.rule) == ("error", "benchmark")
    assert verdict(out_buggy.metrics).status == verdict(out_clean.metrics).status
    assert verdict(out_buggy.metrics, hard_only=True) is None  # rel_l2 under the floor
