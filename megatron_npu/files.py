"""Files the tools write: whole or not at all, 0640 files in 0750 directories.

Ascend's Megatron-LM adaptation guide asks for files 0640 and directories 0750 (its section 6.3
and appendix C) whatever the umask. Every result file (metrics, compare and locate outputs,
parity records, checkpoint manifests and trackers, caches) is written through
:func:`write_private`: into a temp file beside it, fsynced, then renamed over the old one, so a
reader never sees a partial file and a crash or a full disk leaves the previous file intact.
Every directory the tools create comes from :func:`make_dir`. A user's input file is opened
through :func:`open_input`, which reads a gzip-compressed one as its content.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile
import zlib
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o640
DIR_MODE = 0o750
#: the first two bytes of a gzip file: how a user's compressed input is told from plain text
GZIP_MAGIC = b"\x1f\x8b"
#: what reading a damaged gzip file raises
GZIP_ERRORS = (OSError, EOFError, zlib.error)


def open_input(path: str | os.PathLike[str]) -> tuple[BinaryIO, bool]:
    """``path`` opened to read bytes, through gzip's decompressor when its first bytes are
    gzip's (an archived ``train.log.gz``, ``corpus.jsonl.gz``); and whether they are. Opening
    raises what :func:`open` raises; reading a damaged archive, one of :data:`GZIP_ERRORS`."""
    with open(path, "rb") as probe:
        compressed = probe.read(2) == GZIP_MAGIC
    return (gzip.open(path, "rb") if compressed else open(path, "rb")), compressed


def make_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p`` that gives every directory it creates mode 0750 (umask-independent); safe
    when another process creates the same directories at the same time."""
    path = Path(os.path.abspath(os.fspath(path)))
    missing = []
    probe = path
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
    return path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a file creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically with mode 0640, creating missing
    parent directories 0750 (a run must never lose its results to a missing folder at the
    end); returns the path. A failure at any point leaves any previous file and no temp file."""
    path = Path(path)
    make_dir(path.parent)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), FILE_MODE)
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the file is complete either way; this makes it durable
        fsync_dir(path.parent)
    return path
