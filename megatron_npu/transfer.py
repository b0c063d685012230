"""Transparent mode: torch's CUDA spellings mean the active device, process-wide.

``megatron_npu.apply(device, transfer=True)`` (or ``import megatron_npu.auto``) installs this on
top of the registry patches, so an unmodified Megatron-Core *user script* runs on ``device``:

* ``torch.cuda.*`` device, RNG, stream, event, memory, property and graph calls answer for the
  active device (``device_count()`` is the number of local ranks, one virtual device each;
  ``current_device()`` is the index given to ``set_device()``, as on CUDA);
* ``torch.device("cuda")``, tensor factories with ``device="cuda"``, ``Tensor.cuda()``,
  ``Tensor.to("cuda")``, ``Module.cuda()`` and ``Module.to("cuda")`` land on the active device;
* ``torch.distributed.init_process_group()`` / ``new_group()`` with no backend or ``"nccl"`` use
  the device's backend (gloo on cpu and npu-emulated, hccl on npu);
* on torch built for CUDA, ``torch.accelerator.is_available()`` stays CUDA's own answer: that
  namespace is the build's device, whose stream calls torch's optimizers make when it says yes;
* ``torch.cuda.memory``'s allocator history (``_record_memory_history``, ``_snapshot``,
  ``_dump_snapshot``) and ``torch._C._cuda_attach_out_of_memory_observer``, which Megatron-LM's
  ``--record-memory-history`` calls, answer for the device
  (:mod:`megatron_npu.devices.memory_history`), on every device but ``cuda``.

On a real ``npu`` with torch_npu's own ``torch_npu.contrib.transfer_to_npu`` available, that
module does the mapping instead (it is imported, and every attribute it rebinds in the namespaces
of :data:`SNAPSHOT_NAMESPACES` is recorded so :func:`uninstall` can put it back). ``cuda`` needs
nothing. Without ``transfer`` the adaptor stays targeted: only Megatron's own modules see the
routing, and no process-wide wrapper taxes other torch code.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from megatron_npu.devices import Device, memory_history
from megatron_npu.devices.memory_history import MEMORY_API, OOM_OBSERVER_API
from megatron_npu.devices.torch_namespace import (
    FACTORIES,
    REAL_DEVICE,
    RoutedDevice,
    map_device,
    route_device,
)

TORCH_NPU_TRANSFER = "torch_npu.contrib.transfer_to_npu"

#: ``torch.cuda`` names answered by the device's accelerator object.
CUDA_API = (
    "is_available",
    "is_initialized",
    "_lazy_init",
    "synchronize",
    "device",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "initial_seed",
    "default_generators",
    "current_stream",
    "default_stream",
    "stream",
    "set_stream",
    "Stream",
    "Event",
    "is_current_stream_capturing",
    "CUDAGraph",
    "nvtx",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "empty_cache",
    "mem_get_info",
    "memory_stats",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "temperature",
    "power_draw",
    "utilization",
    "clock_rate",
)
#: the same RNG functions as ``torch.cuda.random.*``
CUDA_RANDOM_API = (
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "initial_seed",
)
#: where torch_npu's transfer module rebinds names (what :func:`uninstall` can put back)
SNAPSHOT_NAMESPACES = (
    "torch",
    "torch.cuda",
    "torch.cuda.random",
    "torch.Tensor",
    "torch.nn.Module",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.nn.parallel",
    "torch.utils.data.DataLoader",
    "builtins",
)

_MISSING = object()


@dataclass
class _Binding:
    owner: Any
    name: str
    original: Any  # _MISSING when the owner did not hold the name itself


_bindings: list[_Binding] = []
_torch_npu_transfer_loaded = False
_lock = threading.RLock()


def _set(owner: Any, name: str, value: Any) -> None:
    original = vars(owner).get(name, _MISSING)
    _bindings.append(_Binding(owner, name, original))
    setattr(owner, name, value)


def installed() -> bool:
    return bool(_bindings) or _torch_npu_transfer_loaded


class _LocalDevices:
    """CUDA's device numbering on a device with one virtual device per local rank."""

    def __init__(self) -> None:
        self.index = int(os.environ.get("LOCAL_RANK", "0") or 0)

    def device_count(self) -> int:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), self.index + 1)

    def current_device(self) -> int:
        return self.index

    def set_device(self, device: Any) -> None:
        mapped = device if isinstance(device, int) else REAL_DEVICE(device).index
        if mapped is not None:
            self.index = int(mapped)


def _backend_for(device: Device, function: Any, *, default: bool) -> Any:
    """``function`` with a ``"nccl"`` backend (and, if ``default``, no backend) mapped to the
    device's backend."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def with_device_backend(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if (backend is None and default) or str(backend).lower() == "nccl":
            bound.arguments["backend"] = device.dist_backend
        return function(*bound.args, **bound.kwargs)

    return with_device_backend


def _map_first_device_argument(method: Any) -> Any:
    """``Tensor.to`` / ``Module.to``: map a device given positionally or as ``device=``."""

    @functools.wraps(method)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor, bool)):
            args = (map_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        return method(self, *args, **kwargs)

    return to


def _to_active(device: Device) -> Any:
    def cuda(self: Any, device_arg: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        return self.to(device.torch_device(), non_blocking=non_blocking)

    return cuda


def _loader_with_own_generator(init: Any) -> Any:
    """For a host-only device (``cpu``, ``npu-emulated``). ``DataLoader(...)`` without a
    ``generator`` draws its workers' base seed from torch's default CPU generator each time an
    iterator starts. On CUDA that generator is not the one dropout uses; here the "CUDA"
    generator *is* the CPU generator, so the draw would shift the
    dropout stream by where in the run the loader happens to start (Megatron-LM builds it after
    loading a checkpoint, so a resumed run would not repeat the straight one). The loader gets a
    generator of its own, seeded from the process's initial seed, as CUDA's separation implies.

    ``pin_memory`` is switched off: page-locked host memory only speeds host-to-device copies,
    and there is no device here (a CUDA build of torch would ask the absent driver for one).
    A real ``npu`` keeps the loader as torch ships it: pinned batches and the device's own
    generator for dropout."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.pin_memory = False
        if self.generator is None:
            own = torch.Generator()
            own.manual_seed(torch.initial_seed())
            self.generator = own

    return __init__


def _install_memory_history(device: Device) -> None:
    """``torch.cuda.memory``'s allocator-history calls and torch._C's out-of-memory observer hook
    answered by the device (:mod:`megatron_npu.devices.memory_history`)."""
    history = memory_history.of(device)
    for name in MEMORY_API:
        _set(torch.cuda.memory, name, getattr(history, name))
    _set(torch._C, OOM_OBSERVER_API, history.attach_out_of_memory_observer)


def _install_mapping(device: Device) -> None:
    accelerator = device.accelerator
    local = _LocalDevices()
    # what torch was built for: a CUDA build's torch.accelerator asks torch.cuda.is_available(),
    # which answers for the active device below; its stream calls would still go to CUDA
    built_for = torch.accelerator.current_accelerator()
    if built_for is not None and built_for.type == "cuda":
        _set(torch.accelerator, "is_available", torch.cuda.is_available)
    for owner, names in ((torch.cuda, CUDA_API), (torch.cuda.random, CUDA_RANDOM_API)):
        for name in names:
            try:
                answer = getattr(accelerator, name)
            except AttributeError:  # the accelerator has no counterpart: torch's own stays
                continue
            _set(owner, name, answer)
    for name in ("device_count", "current_device", "set_device"):
        _set(torch.cuda, name, getattr(local, name))
    _set(torch, "device", RoutedDevice)
    for name in FACTORIES:
        _set(torch, name, route_device(getattr(torch, name)))
    _set(torch.Tensor, "cuda", _to_active(device))
    _set(torch.Tensor, "to", _map_first_device_argument(torch.Tensor.to))
    _set(torch.nn.Module, "cuda", _to_active(device))
    _set(torch.nn.Module, "to", _map_first_device_argument(torch.nn.Module.to))
    if device.torch_type == "cpu":  # a host-only device: the loader's two assumptions fail
        loader = torch.utils.data.DataLoader
        _set(loader, "__init__", _loader_with_own_generator(loader.__init__))
    for name, default in (("init_process_group", True), ("new_group", False)):
        function = getattr(torch.distributed, name)
        _set(torch.distributed, name, _backend_for(device, function, default=default))
    _install_memory_history(device)


def _namespace(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module_name), attr)


def _install_torch_npu_transfer() -> None:
    """Import torch_npu's transfer module, recording every name it rebinds."""
    global _torch_npu_transfer_loaded
    namespaces = [_namespace(n) for n in SNAPSHOT_NAMESPACES]
    before = [dict(vars(ns)) for ns in namespaces]
    importlib.import_module(TORCH_NPU_TRANSFER)
    _torch_npu_transfer_loaded = True
    for ns, old in zip(namespaces, before, strict=True):
        for name, value in dict(vars(ns)).items():
            if old.get(name, _MISSING) is not value:
                _bindings.append(_Binding(ns, name, old.get(name, _MISSING)))


def has_torch_npu_transfer() -> bool:
    try:
        return importlib.util.find_spec(TORCH_NPU_TRANSFER) is not None
    except ImportError:
        return False


def install(device: Device) -> str:
    """Install transparent mode for ``device``; returns how (``native``, ``torch_npu`` or
    ``megatron-npu``). Call :func:`uninstall` first to switch devices."""
    with _lock:
        if installed():
            raise RuntimeError("transparent mode is already installed: uninstall() first")
        if device.torch_type == "cuda":
            return "native"
        if device.name == "npu" and has_torch_npu_transfer():
            try:
                _install_torch_npu_transfer()
                # torch_npu's transfer module leaves torch's CUDA allocator-history names
                _install_memory_history(device)
            except BaseException:
                uninstall()
                raise
            return "torch_npu"
        try:
            _install_mapping(device)
        except BaseException:
            uninstall()
            raise
        return "megatron-npu"


def uninstall() -> None:
    """Put back every name transparent mode rebound (torch_npu's included)."""
    global _torch_npu_transfer_loaded
    with _lock:
        while _bindings:
            binding = _bindings.pop()
            if binding.original is _MISSING:
                if binding.name in vars(binding.owner):
                    delattr(binding.owner, binding.name)
            else:
                setattr(binding.owner, binding.name, binding.original)
        if _torch_npu_transfer_loaded:
            sys.modules.pop(TORCH_NPU_TRANSFER, None)  # a later install imports it afresh
            _torch_npu_transfer_loaded = False
