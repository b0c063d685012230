"""One live run per output: ``--metrics-out PATH`` and ``--save DIR`` are held with a lock on
``PATH.lock`` / ``DIR/.megatron-npu.lock``.

The process that lives as long as the run (the launcher, or the one process of a single-rank
run, or global rank 0 under torchrun) takes an exclusive ``flock`` on the lock file before any
rank starts (:func:`hold`). A second run naming the same file or directory is refused with a
named error instead of both exiting 0 with one run's metrics lost, or both saving into one
checkpoint directory. The kernel drops the lock when its holder
dies, whatever kills it, so a crashed run never leaves a stale lock; :func:`release_all` (end of
the run) also removes the lock files.
"""

from __future__ import annotations

import fcntl
import os

from megatron_npu.files import FILE_MODE, make_dir
from megatron_npu.training.errors import TrainingInputError

LOCK_SUFFIX = ".lock"

#: lock path -> open descriptor, for the locks this process holds.
_held: dict[str, int] = {}


#: The lock file inside a held directory (``--save``); a file's lock is its sibling.
DIR_LOCK_NAME = ".megatron-npu.lock"


def lock_path(path: str | os.PathLike[str], directory: bool = False) -> str:
    path = os.path.abspath(os.fspath(path))
    return os.path.join(path, DIR_LOCK_NAME) if directory else path + LOCK_SUFFIX


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (process {text})" if text.isdigit() else ""


def hold(path: str | os.PathLike[str], flag: str, *, directory: bool = False) -> str:
    """Lock ``path`` (a file, or with ``directory`` a directory, created if missing) for this
    process's run, or raise naming ``flag`` when a live run holds it. Holding it already (an
    in-process re-run) is fine. Returns the lock file's path."""
    lock = lock_path(path, directory)
    if lock in _held:
        return lock
    try:
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
                    f"give this run its own {flag}, or wait for the other run to end",
                ) from None
            try:  # the holder before us may have removed the file after we opened it: retry
                same = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
    except OSError as exc:
        raise TrainingInputError(
            f"{flag} {path}: its lock file {lock} cannot be created ({exc.strerror})",
            f"give a {flag} in a writable directory",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[lock] = fd
    return lock


def release_all() -> None:
    """Drop every lock :func:`hold` took in this process and remove the lock files."""
    for lock, fd in list(_held.items()):
        del _held[lock]
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass
        os.close(fd)
