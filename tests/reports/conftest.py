"""Inputs shared by the report tests, computed once per session: real parity cells, a real
compare output, a real info file, and a real pytest-benchmark file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import report_fixtures as fx


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory) -> dict[str, Path]:
    """``base``: the real cells; ``planted``: the same cells with the planted bug in one."""
    root = tmp_path_factory.mktemp("parity")
    base = fx.write_parity(root / "base")
    planted = root / "planted"
    shutil.copytree(base, planted)
    fx.write_parity_cell(planted, *fx.PLANTED_CELL, planted=True)  # replaces that cell's record
    return {"base": base, "planted": planted}


@pytest.fixture(scope="session")
def compare_dir(tmp_path_factory) -> Path:
    """The output folder of a real ``megatron-npu compare`` run (fx.COMPARE_MATRIX)."""
    return fx.compare_results(tmp_path_factory.mktemp("compare") / "default")


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory) -> Path:
    """The ``--benchmark-json`` file of a real run of fx.BENCH_SELECTION."""
    return fx.run_benchmarks(tmp_path_factory.mktemp("bench") / "bench.json")


@pytest.fixture(scope="session")
def info_file(tmp_path_factory) -> Path:
    from megatron_npu import info

    path = tmp_path_factory.mktemp("info") / "info.json"
    try:
        path.write_text(json.dumps(info.collect("npu-emulated")), encoding="utf-8")
    finally:
        import megatron_npu

        megatron_npu.restore()
    return path
