"""Run every single-process parity cell's quick examples under coverage.py, in a fresh process,
and the multi-rank cells of the patches that have no single-process layout (context
parallelism), whose rank-pool workers coverage measures too (its multiprocessing support).

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


def _rcfile(out: Path) -> Path:
    """coverage's settings as a file: the rank-pool workers (spawned by multiprocessing) read
    them from there, so they measure the same sources with branches as this process."""
    sources = "\n    ".join(str(REPO / "megatron_npu" / s) for s in SOURCES)
    rc = out / "coveragerc"
    rc.write_text(
        f"[run]\nbranch = True\nparallel = True\nconcurrency = multiprocessing, thread\n"
        f"data_file = {out / 'coverage.dat'}\nsource =\n    {sources}\n"
    )
    return rc


def main(out: Path) -> None:
    cov = coverage.Coverage(config_file=str(_rcfile(out)))
    cov.start()
    # imported under coverage, so that module-level lines and branches count as well
    from megatron_npu.parity.harness import Job, evaluate
    from megatron_npu.parity.matrix import case_examples, cells
    from megatron_npu.parity.metrics import dtype_name
    from megatron_npu.parity.ranks import PoolManager

    from megatron_npu.devices.facts import CPU, NPU_EMULATED
    from megatron_npu.ops import cpu_band_kernel
    from megatron_npu.testing.torch_npu_emulation import count_kernel_calls, record_call_sites

    kernels: dict[str, set[str]] = defaultdict(set)
    errors = []
    every = cells((CPU, NPU_EMULATED))
    # a patch with no single-process layout (context parallelism) is traced on its rank pools
    single = {c.patch.id for c in every if c.parallel.world == 1}
    pools = PoolManager()
    try:
        with record_call_sites() as sites:
            for cell in every:
                if dtype_name(cell.dtype) not in DTYPES:
                    continue
                if cell.parallel.world > 1:
                    if cell.patch.id in single:
                        continue
                    job = Job(
                        cell.patch.id,
                        cell.device,
                        dtype_name(cell.dtype),
                        cell.parallel,
                        case_examples(cell.case.name, "quick"),
                    )
                    record = evaluate(job, pools.get(cell.parallel.world, cell.device))
                    if record.verdict.status == "error":
                        errors.append(cell.id)
                    if cell.device == NPU_EMULATED:
                        kernels[cell.patch.id] |= {
                            k for k, n in (record.kernels or {}).items() if n
                        }
                    continue
                job = Job(
                    cell.patch.id,
                    cell.device,
                    dtype_name(cell.dtype),
                    cell.parallel,
                    case_examples(cell.case.name, "quick"),
                )
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
        pools.close()
        cov.stop()
        cov.save()
        cov.combine()  # this process's data and every rank-pool worker's, one data file
        merged = coverage.CoverageData(basename=str(out / "coverage.dat"))
        merged.update(cov.get_data())
        merged.write()
    cells_out = {
        "errors": errors,
        "kernels": {k: sorted(v) for k, v in kernels.items()},
        "call_sites": sorted([str(Path(f).resolve()), line, k] for f, line, k in sites),
    }
    (out / "cells.json").write_text(json.dumps(cells_out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
