"""How values are written on the page: numbers, statuses, device labels."""

from __future__ import annotations

import math
import shlex
from typing import Any

from reports import devices

#: The colour class of each status word any input uses (parity verdicts, compare rule verdicts
#: and run states, info patch states, benchmark flags); anything else is shown neutral.
STATUS_CLASS = {
    "pass": "pass", "ok": "pass", "applied": "pass", "cached": "pass", "faster": "pass",
    "warning": "warning", "refused": "warning", "slower": "error",
    "error": "error", "fail": "error", "failed": "error",
}  # fmt: skip


def status_class(status: Any) -> str:
    return STATUS_CLASS.get(str(status), "neutral")


def number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(number(v, digits) for v in value) + "]"
    return str(value)


def device_label(label: str, emulated: bool | None = None) -> dict[str, Any]:
    """What a device cell shows: the label, and whether to add the emulation badge."""
    emu = devices.is_emulated(label) if emulated is None else emulated
    return {"name": label, "emulated": bool(emu), "known": devices.known(label),
            "note": devices.EMULATION_NOTE if emu else ""}  # fmt: skip


def command_line(argv: Any) -> str:
    if isinstance(argv, list | tuple) and argv:
        return shlex.join(str(a) for a in argv)
    return "-" if not argv else str(argv)
