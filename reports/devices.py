"""Device labels as reports show them: an emulated device is always said to be an emulation.

The device names and whether a device is an emulation come from :mod:`megatron_npu.devices`
(the source of truth); this module only turns a label into words for the page.
"""

from __future__ import annotations

from functools import cache

from megatron_npu.devices.facts import DEVICES

EMULATION_NOTE = "emulation on CPU, not an NPU result"


@cache
def is_emulated(label: str) -> bool:
    """True for a device whose kernels are an emulation (``npu-emulated``), by asking the device.

    A real device that is unavailable on this machine (``npu``, ``cuda``) is not an emulation;
    an unknown label is not either (callers name it as unknown).
    """
    if label not in DEVICES:
        return False
    from megatron_npu import devices

    try:
        return bool(devices.make(label).emulated)
    except Exception:  # noqa: BLE001 - unavailable here means a real device elsewhere
        return False


def known(label: str) -> bool:
    return label in DEVICES


def describe(label: str) -> str:
    """``npu-emulated (emulation on CPU, not an NPU result)``; other labels unchanged."""
    if is_emulated(label):
        return f"{label} ({EMULATION_NOTE})"
    return label if known(label) else f"{label} (unknown device label)"
