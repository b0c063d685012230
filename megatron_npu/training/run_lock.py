"""One live run per output file: ``--metrics-out PATH`` is held with a lock on ``PATH.lock``.

The process that lives as long as the run (the launcher, or the one process of a single-rank
run, or global rank 0 under torchrun) takes an exclusive ``flock`` on ``PATH.lock`` before any
rank starts (:func:`hold`). A second run naming the same file is refused with a named error
instead of both exiting 0 with one run's metrics lost. The kernel drops the lock when its holder
dies, whatever kills it, so a crashed run never leaves a stale lock; :func:`release` (end of the
run) also removes the lock file.
"""

from __future__ import annotations

import fcntl
import os

from megatron_npu.training.errors import TrainingInputError
from megatron_npu.training.security import FILE_MODE, make_dir

LOCK_SUFFIX = ".lock"

#: lock path -> open descriptor, for the locks this process holds.
_held: dict[str, int] = {}


def lock_path(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(path)) + LOCK_SUFFIX


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (process {text})" if text.isdigit() else ""


def hold(path: str | os.PathLike[str], flag: str = "--metrics-out") -> None:
    """Lock ``path`` for this process's run, or raise naming ``flag`` when a live run holds it.
    Holding it already (an in-process re-run) is fine."""
    lock = lock_path(path)
    if lock in _held:
        return
    make_dir(os.path.dirname(lock))
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise TrainingInputError(
                f"{flag} {path} is in use by another live run{holder} (lock {lock})",
                f"give this run its own {flag} file, or wait for the other run to end",
            ) from None
        try:  # the holder before us may have removed the file after we opened it: retry
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[lock] = fd


def release(path: str | os.PathLike[str]) -> None:
    """Drop the lock :func:`hold` took on ``path`` and remove the lock file."""
    fd = _held.pop(lock_path(path), None)
    if fd is None:
        return
    try:
        os.unlink(lock_path(path))
    except FileNotFoundError:
        pass
    os.close(fd)


def release_all() -> None:
    for lock in list(_held):
        release(lock[: -len(LOCK_SUFFIX)])
