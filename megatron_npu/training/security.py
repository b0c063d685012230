"""File-permission hardening Ascend's Megatron-LM adaptation guide asks for (its section 6.3 and appendix C).

* the training process runs with umask 027, so what it creates is at most 0640 / 0750;
* checkpoint files are set to 0640 and checkpoint directories to 0750 explicitly after a save,
  whatever the writer asked for (torch's writers may create files 0644 on their own);
* running as root is warned about once (not refused: containers commonly run as root).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

UMASK = 0o027
FILE_MODE = 0o640
DIR_MODE = 0o750

_root_warned = False


class RunningAsRootWarning(UserWarning):
    pass


def set_umask() -> int:
    """Set the process umask to 027; returns the previous one."""
    return os.umask(UMASK)


def warn_if_root() -> bool:
    """Warn once per process when running as root; True if it is root."""
    global _root_warned
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if is_root and not _root_warned:
        _root_warned = True
        warnings.warn(
            "megatron-npu train is running as root; the Ascend guide advises a non-root account "
            "(files are still written 0640, directories 0750)",
            RunningAsRootWarning,
            stacklevel=2,
        )
    return is_root


def harden_tree(root: str | os.PathLike[str]) -> None:
    """chmod ``root`` and everything below it: directories 0750, files 0640."""
    root = Path(root)
    if not root.exists():
        return
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, DIR_MODE)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


def make_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p`` with 0750 on each directory it creates."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    path.mkdir(parents=True, exist_ok=True)
    for created in missing:
        os.chmod(created, DIR_MODE)
    return path


def write_private(path: str | os.PathLike[str], data: str) -> None:
    """Write ``data`` atomically (temp file + rename) with mode 0640, creating missing parent
    directories 0750 (a run must never lose its results to a missing folder at the end)."""
    path = Path(path)
    make_dir(path.parent)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
