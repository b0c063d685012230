"""Building a session input once per pytest invocation, also under ``pytest -n N``: the first
worker to ask builds it in the directory all workers share (the ``xdist_shared`` fixture of
``tests/conftest.py``), behind a file lock; the others wait for it and read it back."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(shared: Path, name: str, build: Callable[[Path], object]) -> Path:
    """``shared/name``, built by ``build(shared/name)`` by the first worker to ask; a build
    that did not finish (its worker died) is removed and done again."""
    target = shared / name
    done = shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.is_file():
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            build(target)
            done.touch()
    return target
