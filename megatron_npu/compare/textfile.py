"""Reading a user's file as UTF-8 text, with one named error for each way it can fail. A
gzip-compressed file (an archived cluster log, ``train.log.gz``) reads as its content."""

from __future__ import annotations

from pathlib import Path

from megatron_npu.files import GZIP_ERRORS, open_input


def read_text(path: Path, error: type[Exception], what: str, expected: str = "") -> str:
    """The file's text (decompressed when it is gzip); ``error`` names the file when it cannot be
    read or decompressed, is empty (blank) or is not UTF-8 (then the message says it is not a
    ``what``, and ``expected`` what was)."""
    compressed = False
    try:
        handle, compressed = open_input(path)
        with handle:
            raw = handle.read()
    except GZIP_ERRORS as exc:
        if compressed:
            raise error(f"{path}: a damaged gzip file ({exc})") from None
        raise error(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not raw.strip():
        raise error(f"{path}: empty file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hint = f": {expected}" if expected else ""
        raise error(f"{path}: not a {what} (byte {exc.start} is not UTF-8){hint}") from None
