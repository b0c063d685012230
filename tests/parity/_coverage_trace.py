"""Run every single-process parity cell's quick examples under coverage.py, in a fresh process.

``python tests/parity/_coverage_trace.py OUT`` writes ``OUT/coverage.dat`` (branch data over
:data:`SOURCES` of ``megatron_npu``) and ``OUT/cells.json`` (cells in error, the emulated
torch_npu kernels each npu-emulated patch called, and the places in the package they were called
from). ``test_branch_coverage.py`` starts it as a
subprocess so that no earlier test in the pytest process has filled the process-level caches
(the C++ kernel's build status, the causal-mask caches) whose first-call branches would then go
untaken: the share measured does not depend on test order.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import coverage

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("ops", "patches", "modules", "optim")
DTYPES = ("float32", "float16")
#: its cpu cells run twice: with the C++ band forward and with the ATen flash pieces
ATTENTION = "attention.dot-product"


def main(out: Path) -> None:
    cov = coverage.Coverage(
        branch=True,
        data_file=str(out / "coverage.dat"),
        source=[str(REPO / "megatron_npu" / s) for s in SOURCES],
    )
    cov.start()
    # imported under coverage, so that module-level lines and branches count as well
    from megatron_npu.parity.harness import Job, evaluate
    from megatron_npu.parity.matrix import case_examples, cells
    from megatron_npu.parity.metrics import dtype_name

    from megatron_npu.ops import cpu_band_kernel
    from megatron_npu.registry import CPU, NPU_EMULATED
    from megatron_npu.testing.torch_npu_emulation import count_kernel_calls, record_call_sites

    kernels: dict[str, set[str]] = defaultdict(set)
    errors = []
    try:
        with record_call_sites() as sites:
            for cell in cells((CPU, NPU_EMULATED)):
                if cell.parallel.world > 1 or dtype_name(cell.dtype) not in DTYPES:
                    continue
                job = Job(cell.patch.id, cell.device, dtype_name(cell.dtype), cell.parallel,
                          case_examples(cell.case.name, "quick"))  # fmt: skip
                with count_kernel_calls() as calls:
                    record = evaluate(job)
                if record.verdict.status == "error":
                    errors.append(cell.id)
                if cell.device == NPU_EMULATED:
                    kernels[cell.patch.id] |= {name for name, n in calls.items() if n}
                if cell.device == CPU and cell.patch.id == ATTENTION:
                    # the CPU band forward without its C++ kernel (no compiler): the flash pieces
                    previous = os.environ.get(cpu_band_kernel.ENV_VAR)
                    os.environ[cpu_band_kernel.ENV_VAR] = "0"
                    try:
                        if evaluate(job).verdict.status == "error":
                            errors.append(f"{cell.id} (C++ band kernel off)")
                    finally:
                        if previous is None:
                            del os.environ[cpu_band_kernel.ENV_VAR]
                        else:
                            os.environ[cpu_band_kernel.ENV_VAR] = previous
    finally:
        cov.stop()
        cov.save()
    cells_out = {
        "errors": errors,
        "kernels": {k: sorted(v) for k, v in kernels.items()},
        "call_sites": sorted([str(Path(f).resolve()), line, k] for f, line, k in sites),
    }
    (out / "cells.json").write_text(json.dumps(cells_out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
