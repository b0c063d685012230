"""Inputs for the report tests: a real ``compare`` run of a tiny matrix, real parity cells (a few
cells of one patch, from the harness), and a real pytest-benchmark run of a few perf/ cells."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

#: The patch whose real parity cells the tests compute, and the planted bug the diff must show.
PARITY_PATCH = "activation.bias-swiglu"
PLANTED = "swiglu-swapped-halves"
PARITY_DEVICES = ("cpu", "npu-emulated")
PARITY_DTYPES = ("float32", "bfloat16")
PLANTED_CELL = ("cpu", "float32")  # (device, dtype) that gets the bug in the "planted" run


def parity_job(device: str, dtype: str, *, planted: bool = False) -> Any:
    """A real parity job of PARITY_PATCH (the planted bug's examples), optionally with the bug."""
    from megatron_npu.parity.case import Parallel
    from megatron_npu.parity.harness import Job
    from megatron_npu.parity.mutations import MUTATIONS

    mutation = MUTATIONS[PLANTED]
    assert mutation.patch_id == PARITY_PATCH
    return Job(
        PARITY_PATCH,
        device,
        dtype,
        Parallel(),
        mutation.examples,
        mutation=PLANTED if planted else None,
    )


def write_parity_cell(directory: Path, device: str, dtype: str, *, planted: bool = False) -> Path:
    """Evaluate one cell and write its record (replacing a record of the same cell)."""
    from megatron_npu.parity.harness import evaluate
    from megatron_npu.parity.results import write_record

    import megatron_npu

    try:
        return write_record(evaluate(parity_job(device, dtype, planted=planted), seed=7), directory)
    finally:
        megatron_npu.restore()


def write_parity(directory: Path) -> Path:
    """Every PARITY_DEVICES x PARITY_DTYPES cell of PARITY_PATCH, without the bug."""
    for device in PARITY_DEVICES:
        for dtype in PARITY_DTYPES:
            write_parity_cell(directory, device, dtype)
    return directory


#: The comparison the report tests read: a real ``megatron-npu compare`` of this matrix, run once
#: per session (:func:`compare_results`); never a hand-written results file.
COMPARE_MATRIX = """
[compare]
baseline = "cpu-tp1"

[defaults]
layout-independent-init = true
num-layers = 1
hidden-size = 32
num-attention-heads = 2
seq-length = 64
micro-batch-size = 2
global-batch-size = 4
train-iters = 8
lr = 5e-3
attention-dropout = 0.0
hidden-dropout = 0.0
log-interval = 4
seed = 1234

[[run]]
name = "cpu-tp1"
device = "cpu"

[[run]]
name = "cpu-tp2"
device = "cpu"
options = { nproc-per-node = 2, tensor-model-parallel-size = 2 }

[[run]]
name = "emu-tp2"
device = "npu-emulated"
options = { nproc-per-node = 2, tensor-model-parallel-size = 2 }
"""
RUNS = (  # name, device, emulated: what COMPARE_MATRIX runs
    ("cpu-tp1", "cpu", False),
    ("cpu-tp2", "cpu", False),
    ("emu-tp2", "npu-emulated", True),
)


def compare_results(directory: Path) -> Path:
    """Run COMPARE_MATRIX with the product's own ``compare`` into ``directory``."""
    import io

    import pytest

    from megatron_npu.compare import command
    from megatron_npu.compare.matrix import load

    directory.mkdir(parents=True, exist_ok=True)
    matrix = directory / "matrix.toml"
    matrix.write_text(COMPARE_MATRIX, encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        echo = io.StringIO()
        with contextlib.redirect_stdout(echo):
            _, status = command.run_compare(load(matrix), directory)
    assert status == 0, echo.getvalue()[-3000:]
    return directory


def s_per_step_interval(source: Path, name: str) -> tuple[float, float]:
    """The 95 % confidence interval of run ``name``'s s/step in a compare output."""
    data = json.loads((source / "results.json").read_text(encoding="utf-8"))
    run = next(r for r in data["runs"] if r["name"] == name)
    lo, hi = run["perf"]["ci95_s_per_step"]
    return float(lo), float(hi)


def copy_results(source: Path, directory: Path, *, slower: float = 1.0) -> Path:
    """A copy of a real compare output's results.json, every step time and s/step of the run
    ``cpu-tp2`` (and of its Table 2 row) multiplied by ``slower`` (the diff tests' speed change)."""
    data = json.loads((source / "results.json").read_text(encoding="utf-8"))
    for run in data["runs"]:
        if run["name"] != "cpu-tp2":
            continue
        for step in run["steps"]:
            step["step_time_s"] *= slower
        perf = run["perf"]
        perf["median_s_per_step"] *= slower
        perf["ci95_s_per_step"] = [t * slower for t in perf["ci95_s_per_step"]]
    for row in data["table2"]:
        if row["name"] == "cpu-tp2":
            row["s_per_step"] *= slower
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return directory


#: The benchmark cells the report tests read: a real pytest-benchmark run of the project's own
#: suite (perf/, at its quick size), two ops, each on the Megatron path, the native path and the
#: emulated NPU binding; never a hand-written JSON file.
BENCH_SELECTION = "(bias-swiglu or bias-gelu) and float32 and fwd and not bwd"
TIMING_KEYS = (
    "min",
    "max",
    "mean",
    "stddev",
    "median",
    "iqr",
    "q1",
    "q3",
    "ld15iqr",
    "hd15iqr",
    "total",
)


def run_benchmarks(path: Path) -> Path:
    """``pytest perf/test_patched_ops_bench.py --perf-quick -k BENCH_SELECTION
    --benchmark-json=path``, run for real (about 10 s)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    path.parent.mkdir(parents=True, exist_ok=True)
    # an xdist worker's variables make pytest-benchmark in the child believe it is a worker too,
    # and a worker writes no --benchmark-json
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            str(root / "perf" / "test_patched_ops_bench.py"),
            "--perf-quick",
            "-k",
            BENCH_SELECTION,
            f"--benchmark-json={path}",
            "--rootdir",
            str(root),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert path.is_file(), f"pytest-benchmark wrote no {path}:\n{done.stdout[-3000:]}"
    return path


def benchmarks(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8"))["benchmarks"]


def _edited_copy(source: Path, target: Path, edit) -> Path:
    """``target``: the benchmark file ``source`` with ``edit(data)`` applied to its JSON."""
    data = json.loads(source.read_text(encoding="utf-8"))
    edit(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return target


def _set_timings(stats: dict[str, Any], base: dict[str, Any], factor: float) -> None:
    """Every timing of ``stats`` becomes ``base``'s times ``factor`` (and ops/s the inverse)."""
    for key in TIMING_KEYS:
        stats[key] = base[key] * factor
    stats["ops"] = base["ops"] / factor


def scaled_benchmarks(source: Path, target: Path, scale: float) -> Path:
    """A copy of a real benchmark file with every timing multiplied by ``scale`` (the
    speed-change tests)."""

    def edit(data: dict[str, Any]) -> None:
        for bench in data["benchmarks"]:
            _set_timings(bench["stats"], dict(bench["stats"]), scale)

    return _edited_copy(source, target, edit)


def with_paths_relative(source: Path, target: Path, factors: dict[tuple[str, str], float]) -> Path:
    """A copy of a real benchmark file where each (op, path) of ``factors`` takes the timings of
    the same line's Megatron path times its factor: a known ratio on real records."""

    def line(info: dict[str, Any]) -> tuple:
        return info["op"], info["dtype"], info["direction"], info["device"]

    def edit(data: dict[str, Any]) -> None:
        megatron = {
            line(b["extra_info"]): dict(b["stats"])
            for b in data["benchmarks"]
            if b["extra_info"]["path"] == "megatron"
        }
        for bench in data["benchmarks"]:
            info = bench["extra_info"]
            factor = factors.get((info["op"], info["path"]))
            if factor is not None:
                _set_timings(bench["stats"], megatron[line(info)], factor)

    return _edited_copy(source, target, edit)
