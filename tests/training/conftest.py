"""Runs shared across the training tests (each is a real multi-process training run).

Under ``pytest -n N`` every xdist worker has its own session, so the shared runs are computed once
per pytest invocation behind a file lock in the directory all workers share, and read back by the
other workers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from megatron_npu.formats.metrics import MetricsFile

from ._runner import TINY, Run, train


@pytest.fixture(scope="session")
def train_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="session")
def shared_tmp(xdist_shared) -> Path:
    """A directory every xdist worker of this pytest run sees (the session's own otherwise)."""
    root = xdist_shared / "training-shared"
    root.mkdir(exist_ok=True)
    return root


def _once(shared: Path, name: str, compute: Callable[[Path], Run]) -> Run:
    record = shared / f"{name}.run.json"
    with FileLock(str(record) + ".lock"):
        if not record.is_file():
            run = compute(shared)
            record.write_text(json.dumps({"stdout": run.stdout, "path": str(run.metrics_path)}))
    saved = json.loads(record.read_text())
    path = Path(saved["path"])
    return Run(MetricsFile.read(path), saved["stdout"], path)


@pytest.fixture(scope="session")
def baseline(shared_tmp) -> Run:
    """TP1 PP1 DP1, fp32, 10 steps: the reference every layout is compared with."""
    return _once(
        shared_tmp, "baseline", lambda d: train(d, *TINY, "--train-iters", "10", name="baseline")
    )


@pytest.fixture(scope="session")
def tp2_saved(shared_tmp) -> tuple[Run, Path]:
    """TP2, 10 steps, checkpoints at steps 5 and 10: a layout case and the resume source."""
    save = shared_tmp / "ckpt_tp2"

    def compute(directory: Path) -> Run:
        return train(
            directory,
            *TINY,
            "--train-iters",
            "10",
            "--tensor-model-parallel-size",
            "2",
            "--save",
            str(save),
            "--save-interval",
            "5",
            nproc=2,
            name="tp2",
        )

    return _once(shared_tmp, "tp2", compute), save


@pytest.fixture(scope="session")
def dp2_saved(shared_tmp) -> tuple[Run, Path]:
    """DP2 with the distributed optimizer and overlapped grad-reduce / param-gather, started by
    plain torchrun, checkpoints at steps 5 and 10: a layout case and a resume source."""
    save = shared_tmp / "ckpt_dp2"

    def compute(directory: Path) -> Run:
        return train(
            directory,
            *TINY,
            "--train-iters",
            "10",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--save",
            str(save),
            "--save-interval",
            "5",
            nproc=2,
            name="dp2-distopt-overlap",
            torchrun=True,
        )

    return _once(shared_tmp, "dp2", compute), save
