"""One real training run shared by the fault tests: the tiny model, 4 iterations, checkpoints at
iterations 2 and 4 (computed once per pytest invocation, also under xdist, behind a file lock)."""

from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from ._harness import TINY, run


@pytest.fixture(scope="session")
def good_checkpoint(xdist_shared) -> Path:
    shared = xdist_shared / "faults-shared"
    shared.mkdir(exist_ok=True)
    save = shared / "ckpt"
    with FileLock(str(shared / "ckpt.lock")):
        if not (save / "latest_checkpointed_iteration.txt").is_file():
            code, out = run(*TINY, "--save", str(save), "--save-interval", "2")
            assert code == 0, out[-4000:]
    return save
