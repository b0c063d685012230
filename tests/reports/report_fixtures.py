"""Inputs for the report tests: a real ``compare`` run of a tiny matrix, real parity cells (a few
cells of one patch, from the harness), and pytest-benchmark JSON built from its schema."""

from __future__ import annotations

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
    return Job(PARITY_PATCH, device, dtype, Parallel(), mutation.examples,
               mutation=PLANTED if planted else None)  # fmt: skip


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
        _, status = command.run_compare(load(matrix), directory, echo=echo)
    assert status == 0, echo.getvalue()[-3000:]
    return directory


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


BENCHES = (  # op, path, device, emulated, median seconds
    ("rms_norm", "megatron", "cpu", False, 2.0e-3),
    ("rms_norm", "native", "cpu", False, 1.0e-3),
    ("swiglu", "megatron", "cpu", False, 1.0e-3),
    ("swiglu", "native", "cpu", False, 1.5e-3),
    ("rms_norm", "npu-binding", "npu-emulated", True, 4.0e-3),
)


def benchmark_json(path: Path, *, scale: float = 1.0) -> Path:
    """pytest-benchmark JSON (its ``--benchmark-json`` layout) with the extra_info of perf/README.md."""
    benches = []
    for op, bench_path, device, emulated, median in BENCHES:
        m = median * scale
        benches.append({
            "group": op, "name": f"test_{op}[{bench_path}-{device}]",
            "fullname": f"perf/test_ops.py::test_{op}[{bench_path}-{device}]",
            "params": None, "param": None, "options": {},
            "extra_info": {"patch_id": None, "op": op, "path": bench_path, "device": device,
                           "emulated": emulated, "dtype": "float32", "shape": "4x128x256",
                           "direction": "fwd", "peak_memory_bytes": None},
            "stats": {"min": m * 0.9, "max": m * 1.2, "mean": m, "stddev": m * 0.02,
                      "rounds": 10, "median": m, "iqr": m * 0.04, "q1": m * 0.98, "q3": m * 1.02,
                      "iqr_outliers": 0, "stddev_outliers": 0, "outliers": "0;0", "ld15iqr": m,
                      "hd15iqr": m, "ops": 1 / m, "total": m * 10, "iterations": 1},
        })  # fmt: skip
    data = {"machine_info": {"node": "ci", "processor": "x86_64", "python_version": "3.11.7",
                             "cpu": {"brand_raw": "test cpu"}},
            "commit_info": {"id": "abc1234", "branch": "main", "dirty": False},
            "benchmarks": benches, "datetime": "2026-11-22T20:00:00", "version": "5.1.0"}  # fmt: skip
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return path
