"""The Ascend NPU: torch_npu kernels, hccl process groups, ``torch.npu`` RNG and streams.

Loading is careful: importing torch_npu without Ascend's CANN libraries fails half-way (after it
has started patching torch), so :func:`cann_problem` first checks that the CANN shared libraries
can be loaded at all and turns a failure into one message that says what is missing and what to do.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
from types import ModuleType
from typing import Any

import torch

from megatron_npu.devices.base import Device, NoNvtx
from megatron_npu.devices.errors import DeviceUnavailableError
from megatron_npu.devices.facts import NPU
from megatron_npu.devices.memory_history import NpuMemoryHistory

#: Shared libraries of the CANN runtime that torch_npu links against.
CANN_LIBRARIES = ("libascendcl.so", "libhccl.so")
CANN_SETUP_HINT = (
    "install Ascend's CANN toolkit and NPU driver matching this torch_npu, then run "
    "'source /usr/local/Ascend/ascend-toolkit/set_env.sh' (it sets LD_LIBRARY_PATH) before "
    "training; or set MEGATRON_NPU_DEVICE=cpu (or npu-emulated) to run without an NPU"
)


def torch_npu_version() -> str | None:
    """The installed torch_npu distribution's version, without importing it."""
    try:
        return importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _load_library(name: str) -> None:
    ctypes.CDLL(name)


def cann_problem() -> str | None:
    """None if CANN's libraries load, else a one-paragraph explanation naming what is missing."""
    missing = []
    for lib in CANN_LIBRARIES:
        try:
            _load_library(lib)
        except OSError as exc:
            missing.append(f"{lib} ({exc})")
    if not missing:
        return None
    return cann_message("cannot load " + "; ".join(missing))


def cann_message(detail: str) -> str:
    version = torch_npu_version() or "?"
    return (
        f"torch_npu {version} is installed but Ascend's CANN runtime is missing: {detail}. "
        f"To use the NPU, {CANN_SETUP_HINT}."
    )


def import_torch_npu() -> ModuleType:
    """Import torch_npu or raise :class:`DeviceUnavailableError` with a clear message."""
    if not torch_npu_installed():
        raise DeviceUnavailableError(
            "device 'npu' needs torch_npu, which is not installed: "
            "pip install 'megatron-npu[npu]' (torch_npu must match torch "
            f"{torch.__version__.split('+')[0]}), plus Ascend's CANN toolkit"
        )
    problem = cann_problem()
    if problem:
        raise DeviceUnavailableError(problem)
    try:
        import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
    except (ImportError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if ".so" in first:
            raise DeviceUnavailableError(cann_message(first)) from None
        raise DeviceUnavailableError(f"torch_npu failed to import: {first}") from None
    return torch_npu


class NpuAccelerator:
    """``torch.cuda``-shaped answers backed by ``torch.npu`` (from torch_npu)."""

    name = NPU

    nvtx = NoNvtx()

    def __init__(self, npu_module: Any, torch_npu_c: Any) -> None:
        self._npu = npu_module
        #: ``--record-memory-history``'s calls: torch_npu's allocator history
        self.memory_history = NpuMemoryHistory(npu_module, torch_npu_c)

    def current_device(self) -> torch.device:
        # a torch.device so ``.to(torch.cuda.current_device())`` reaches the NPU, not cuda:N
        return torch.device("npu", self._npu.current_device())

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return (0, 0)

    #: ``torch.cuda`` names whose ``torch.npu`` counterpart is spelled differently.
    RENAMED = {"CUDAGraph": "NPUGraph"}

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._npu, self.RENAMED.get(name, name))
        except AttributeError:
            raise AttributeError(
                f"torch.npu has no {name!r}: Megatron asked for torch.cuda.{name}, which the "
                "adaptor does not cover yet (please report it)"
            ) from None


def npu_visible(torch_npu_module: ModuleType) -> bool:
    try:
        return bool(torch.npu.is_available()) and torch.npu.device_count() > 0
    except Exception:  # noqa: BLE001  (driver errors surface as assorted exceptions)
        return False


def make_device() -> Device:
    torch_npu = import_torch_npu()
    if not npu_visible(torch_npu):
        raise DeviceUnavailableError(
            "torch_npu imported but sees no NPU (torch.npu.is_available() is False); check the "
            "driver with 'npu-smi info' and ASCEND_RT_VISIBLE_DEVICES"
        )
    return Device.of(
        NPU,
        accelerator=NpuAccelerator(torch.npu, torch_npu._C),
        kernels=torch_npu,
        kernels_source=f"torch_npu {torch_npu_version() or '(version unknown)'}",
    )
