"""Device layer: which device Megatron runs on, and the answers it needs from it.

One module per device (:mod:`.cpu`, :mod:`.npu`, :mod:`.npu_emulated`, :mod:`.cuda`). Auto-detection
picks ``npu`` when torch_npu imports and sees a device, else ``cpu``; ``cuda`` only when asked;
the ``MEGATRON_NPU_DEVICE`` environment variable overrides.
"""

from __future__ import annotations

import importlib
import os
import warnings

import torch

from megatron_npu.devices.base import Device
from megatron_npu.devices.errors import DeviceUnavailableError, UnknownDeviceError
from megatron_npu.devices.facts import CPU, CUDA, NPU, NPU_EMULATED

ENV_VAR = "MEGATRON_NPU_DEVICE"
_MODULES = {CPU: "cpu", NPU: "npu", NPU_EMULATED: "npu_emulated", CUDA: "cuda"}
NAMES = tuple(_MODULES)

_active: Device | None = None


def make(name: str) -> Device:
    """Build the named device (raises DeviceUnavailableError if it cannot be used here)."""
    if name not in _MODULES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(NAMES)}")
    module = importlib.import_module(f"megatron_npu.devices.{_MODULES[name]}")
    return module.make_device()


def available(name: str) -> bool:
    """Whether runs on ``name`` can start on this machine: cpu and npu-emulated always; npu when
    torch_npu imports and sees a device; cuda when torch sees a GPU."""
    if name not in _MODULES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(NAMES)}")
    if name in (CPU, NPU_EMULATED):
        return True
    if name == CUDA:
        return torch.cuda.is_available()
    from megatron_npu.devices import npu

    if not npu.torch_npu_installed():
        return False
    try:
        npu.make_device()
    except DeviceUnavailableError:
        return False
    return True


def detect() -> str:
    """``npu`` if torch_npu imports and sees a device, else ``cpu`` (with a warning if an
    installed torch_npu cannot load CANN)."""
    from megatron_npu.devices import npu

    if not npu.torch_npu_installed():
        return CPU
    try:
        npu.make_device()
    except DeviceUnavailableError as exc:
        warnings.warn(f"{exc} -- running on cpu instead", RuntimeWarning, stacklevel=2)
        return CPU
    return NPU


def chosen_name(name: str | None = None) -> str | None:
    """The device name asked for: ``name``, else $MEGATRON_NPU_DEVICE; None when neither names
    one (auto-detection then picks ``npu`` or ``cpu``, :func:`detect`)."""
    chosen = name or os.environ.get(ENV_VAR, "").strip() or None
    if chosen is not None and chosen not in _MODULES:
        source = f"${ENV_VAR}" if name is None else "device"
        raise UnknownDeviceError(
            f"{source}={chosen!r} is not a device: choose one of {', '.join(NAMES)}"
        )
    return chosen


def requested_name(name: str | None = None) -> str:
    """The device name asked for: ``name``, else $MEGATRON_NPU_DEVICE, else auto-detection."""
    return chosen_name(name) or detect()


def resolve(name: str | Device | None = None) -> Device:
    if isinstance(name, Device):
        return name
    return make(requested_name(name))


def activate(device: Device) -> None:
    """Make ``device`` the one Megatron's patched code uses (ops read its kernels).

    The kernels are bound only through :func:`megatron_npu.ops.kernels.use_npu_kernels`: the
    emulation of ``npu-emulated`` stays under its own module name and is never registered as
    ``torch_npu``, so ``import torch_npu``, ``find_spec("torch_npu")`` and
    :func:`megatron_npu.devices.npu.torch_npu_installed` keep answering for the real package.
    """
    global _active
    from megatron_npu.ops.kernels import use_npu_kernels

    _active = device
    use_npu_kernels(device.kernels)


def deactivate() -> None:
    global _active
    from megatron_npu.ops.kernels import use_npu_kernels

    use_npu_kernels(None)
    _active = None


def active() -> Device | None:
    return _active


def require_active() -> Device:
    if _active is None:
        raise RuntimeError("megatron-npu is not applied: call megatron_npu.apply(device) first")
    return _active


def current_torch_device() -> torch.device:
    """The torch device of the active adaptor device (CPU if none is active)."""
    return _active.torch_device() if _active else torch.device("cpu")


__all__ = [
    "Device",
    "DeviceUnavailableError",
    "UnknownDeviceError",
    "ENV_VAR",
    "NAMES",
    "activate",
    "active",
    "current_torch_device",
    "deactivate",
    "detect",
    "make",
    "requested_name",
    "resolve",
]
