"""Small inputs for the report tests, built from the schemas of INTERFACES.md (compare results,
pytest-benchmark JSON) and from the real parity harness (a few cells of one patch)."""

from __future__ import annotations

import json
import math
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
    from parity.case import Parallel
    from parity.harness import Job
    from parity.mutations import MUTATIONS

    mutation = MUTATIONS[PLANTED]
    assert mutation.patch_id == PARITY_PATCH
    return Job(PARITY_PATCH, device, dtype, Parallel(), mutation.examples,
               mutation=PLANTED if planted else None)  # fmt: skip


def write_parity_cell(directory: Path, device: str, dtype: str, *, planted: bool = False) -> Path:
    """Evaluate one cell and write its record (replacing a record of the same cell)."""
    import megatron_npu
    from parity.harness import evaluate
    from parity.results import write_record

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


RUNS = (  # name, device, emulated, tensor parallel size, loss offset
    ("cpu-tp1", "cpu", False, 1, 0.0),
    ("cpu-tp2", "cpu", False, 2, 0.002),
    ("emu-tp2", "npu-emulated", True, 2, 0.004),
)
STEPS = 12


def _losses(offset: float) -> list[float]:
    return [5.5 * math.exp(-0.08 * i) + 2.0 + offset * (1 + 0.1 * i) for i in range(STEPS)]


def compare_results(directory: Path, *, slower: float = 1.0) -> Path:
    """A compare output folder with three runs (one emulated) and its rule verdicts."""
    runs = []
    for name, device, emulated, tp, offset in RUNS:
        step_s = (0.2 if tp == 1 else 0.12) * (slower if name == "cpu-tp2" else 1.0)
        runs.append({
            "name": name, "device": device, "emulated": emulated,
            "options": {"--tensor-model-parallel-size": tp, "seed": 1234},
            "config_hash": f"h{tp}", "fingerprint": {"layers": 2}, "status": "ok", "error": None,
            "wall_s": 3.0, "command": ["megatron-npu", "train", "--tensor-model-parallel-size", str(tp)],
            "metrics_path": f"runs/{name}/metrics.json",
            "steps": [{"iteration": i + 1, "loss": loss, "grad_norm": 1.0, "step_time_s": step_s}
                      for i, loss in enumerate(_losses(offset))],
            "perf": {"median_s_per_step": step_s, "ci95_s_per_step": [step_s * 0.98, step_s * 1.02],
                     "tokens_per_s": 1024 / step_s, "model_flops_per_step": 3.2e9,
                     "mfu": None if emulated else 0.01, "peak_tflops": None if emulated else 1.5,
                     "peak_memory_mib": 512.0, "speed_comparable": not emulated},
            "lambada": None,
        })  # fmt: skip
    base = _losses(0.0)
    verdicts = []
    for name, _device, emulated, _tp, offset in RUNS[1:]:
        rel = [(b - a) / abs(a) for a, b in zip(base, _losses(offset))]
        verdicts.append({
            "candidate": name, "baseline": "cpu-tp1", "rule": "approximate", "status": "pass",
            "detail": f"max relative difference {max(map(abs, rel)):.2e} <= 0.05",
            "tolerance": {"rtol": 0.05, "mean_rtol": 0.02, "late_window": 10, "late_growth": 0.01},
            "per_step": {"iteration": list(range(1, STEPS + 1)), "rel_diff": rel},
        })  # fmt: skip
        verdicts.append({
            "candidate": name, "baseline": "cpu-tp1", "rule": "performance",
            "status": "refused" if emulated else "pass",
            "detail": "emulated speed is never compared" if emulated else "within 5 %",
            "tolerance": {}, "per_step": None,
        })  # fmt: skip
    table2 = [
        {"name": r["name"], "device": r["device"], "emulated": r["emulated"], "layout": r["name"][-3:],
         "precision": "fp32", "first_loss": r["steps"][0]["loss"], "last_loss": r["steps"][-1]["loss"],
         "s_per_step": r["perf"]["median_s_per_step"], "s_per_step_ci95": r["perf"]["ci95_s_per_step"],
         "tokens_per_s": r["perf"]["tokens_per_s"], "mfu": r["perf"]["mfu"],
         "mfu_ci95": None if r["emulated"] else [0.0098, 0.0102], "peak_memory_mib": 512.0,
         "verdict": "pass"}
        for r in runs
    ]  # fmt: skip
    data = {
        "schema": "megatron-npu/compare", "schema_version": 1, "matrix": "default",
        "created": "2026-11-22T20:00:00Z",
        "provenance": {"megatron_npu": "0.1.0", "megatron_core": "0.16.1", "torch": "2.13.0+cpu",
                       "commit": "abc1234", "host": "ci", "command": ["megatron-npu", "compare"]},
        "baseline": "cpu-tp1", "runs": runs, "verdicts": verdicts, "table2": table2,
        "skipped": [{"name": "cuda-fp32", "reason": "none of its devices (cuda) is available here"}],
        "notes": ["vocabulary padding aligned to a multiple of 256"],
    }  # fmt: skip
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
    """pytest-benchmark JSON (REFERENCE.md section 5) with INTERFACES.md's extra_info."""
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
