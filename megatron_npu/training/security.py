"""File-permission hardening Ascend's Megatron-LM adaptation guide asks for (its section 6.3
and appendix C).

* the training process runs with umask 027, so what it creates is at most 0640 / 0750;
* checkpoint files are set to 0640 and checkpoint directories to 0750 explicitly after a save,
  whatever the writer asked for (torch's writers may create files 0644 on their own);
* running as root is warned about once (not refused: containers commonly run as root).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from megatron_npu.files import DIR_MODE, FILE_MODE

UMASK = 0o027

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
