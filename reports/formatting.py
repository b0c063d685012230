"""How values are written on the page: numbers, statuses, device labels."""

from __future__ import annotations

import math
import re
import shlex
from typing import Any

from megatron_npu.reports import devices

#: The colour class of each status word any input uses (parity verdicts, compare rule verdicts
#: and run states, info patch states, benchmark flags); anything else is shown neutral.
STATUS_CLASS = {
    "pass": "pass",
    "ok": "pass",
    "applied": "pass",
    "cached": "pass",
    "faster": "pass",
    "warning": "warning",
    "refused": "warning",
    "slower": "error",
    "error": "error",
    "fail": "error",
    "failed": "error",
}


_CLASS_ORDER = ("neutral", "pass", "warning", "error")


def status_class(status: Any) -> str:
    """The colour of a status word, or of a status phrase (Table 2's ``FAIL layout vs emu``,
    ``pass approximate vs ref; SLOWER``): its most severe status word decides."""
    text = str(status)
    if text in STATUS_CLASS:
        return STATUS_CLASS[text]
    found = [STATUS_CLASS[w] for w in re.findall(r"[a-z]+", text.lower()) if w in STATUS_CLASS]
    return max(found, key=_CLASS_ORDER.index, default="neutral")


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
        if 1e4 <= abs(value) < 1e12:  # throughputs and byte counts: whole numbers with separators
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(number(v, digits) for v in value) + "]"
    return str(value)


def device_label(label: str, emulated: bool | None = None) -> dict[str, Any]:
    """What a device cell shows: the label, and whether to add the emulation badge."""
    emu = devices.is_emulated(label) if emulated is None else emulated
    return {
        "name": label,
        "emulated": bool(emu),
        "known": devices.known(label),
        "note": devices.EMULATION_NOTE if emu else "",
    }


def command_line(argv: Any) -> str:
    if isinstance(argv, list | tuple) and argv:
        return shlex.join(str(a) for a in argv)
    return "-" if not argv else str(argv)
