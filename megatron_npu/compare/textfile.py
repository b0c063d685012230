"""Reading a user's file as UTF-8 text, with one named error for each way it can fail."""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path, error: type[Exception], what: str, expected: str = "") -> str:
    """The file's text; ``error`` names the file when it cannot be read, is empty (blank) or is
    not UTF-8 (then the message says it is not a ``what``, and ``expected`` what was)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not raw.strip():
        raise error(f"{path}: empty file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hint = f": {expected}" if expected else ""
        raise error(f"{path}: not a {what} (byte {exc.start} is not UTF-8){hint}") from None
