"""Inputs shared by the report tests, computed once per pytest invocation (also under xdist,
:func:`once_per_run.built_once`): real parity cells, a real compare output, a real info file, and a
real pytest-benchmark file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import report_fixtures as fx
from once_per_run import built_once


@pytest.fixture(scope="session")
def parity_runs(xdist_shared) -> dict[str, Path]:
    """``base``: the real cells; ``planted``: the same cells with the planted bug in one."""

    def build(root: Path) -> None:
        base = fx.write_parity(root / "base")
        shutil.copytree(base, root / "planted")
        # replaces that cell's record
        fx.write_parity_cell(root / "planted", *fx.PLANTED_CELL, planted=True)

    root = built_once(xdist_shared, "reports-parity", build)
    return {"base": root / "base", "planted": root / "planted"}


@pytest.fixture(scope="session")
def compare_dir(xdist_shared) -> Path:
    """The output folder of a real ``megatron-npu compare`` run (fx.COMPARE_MATRIX)."""
    root = built_once(xdist_shared, "reports-compare", lambda d: fx.compare_results(d / "default"))
    return root / "default"


@pytest.fixture(scope="session")
def bench_file(xdist_shared) -> Path:
    """The ``--benchmark-json`` file of a real run of fx.BENCH_SELECTION."""
    root = built_once(xdist_shared, "reports-bench", lambda d: fx.run_benchmarks(d / "bench.json"))
    return root / "bench.json"


@pytest.fixture(scope="session")
def info_file(xdist_shared) -> Path:
    def build(root: Path) -> None:
        from megatron_npu import info

        root.mkdir(parents=True)
        try:
            text = json.dumps(info.collect("npu-emulated"))
        finally:
            import megatron_npu

            megatron_npu.restore()
        (root / "info.json").write_text(text, encoding="utf-8")

    return built_once(xdist_shared, "reports-info", build) / "info.json"
