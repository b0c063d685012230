"""A module-scoped stand-in for ``torch`` that routes Megatron's CUDA assumptions.

Installed as the ``torch`` global of selected Megatron modules (see
:mod:`megatron_npu.patches.device_namespace`), it forwards every attribute to the real torch
except:

* ``torch.cuda`` -> the active device's accelerator API (RNG, streams, memory, properties, nvtx);
* tensor factories (``empty``, ``zeros``, ``tensor``, ``arange``, ...) and ``torch.device``: a
  ``device`` of ``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or a bare int becomes the
  active device; on a host-only device (``cpu``, ``npu-emulated``) ``pin_memory=True`` is
  dropped, since there is no accelerator to pin host memory for.

Only code in the patched modules sees it, so no process-wide ``TorchFunctionMode`` taxes every
torch call. Every other attribute is read from torch at the moment it is used, never kept: what
torch holds under a name changes while the process runs (the registry's ``matmul.*`` entries
wrap ``torch.bmm`` and the rest, and switching the adaptor off or the parity harness's reference
puts torch's own back), and a kept copy would go on calling whichever was there first.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from megatron_npu import devices

#: torch's own device type, kept so the routed stand-in can refer to it while installed as
#: ``torch.device`` (transparent mode).
REAL_DEVICE = torch.device

#: Factories whose ``device=`` argument is redirected.
FACTORIES = (
    "arange",
    "as_tensor",
    "empty",
    "empty_like",
    "empty_strided",
    "eye",
    "full",
    "full_like",
    "linspace",
    "ones",
    "ones_like",
    "rand",
    "rand_like",
    "randint",
    "randn",
    "randn_like",
    "randperm",
    "tensor",
    "zeros",
    "zeros_like",
)


def map_device(device: Any) -> Any:
    """Translate a CUDA device designation into the active device; leave others alone."""
    active = devices.active()
    if active is None or active.torch_type == "cuda" or device is None:
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return active.torch_device(device)
    if isinstance(device, str):
        if device.startswith("cuda"):
            index = device.partition(":")[2]
            if index and not index.isdigit():
                # f"cuda:{torch.cuda.current_device()}": the active device's current device,
                # which its accelerator API renders as a device ("cpu", "npu:0")
                return REAL_DEVICE(index)
            return active.torch_device(int(index) if index.isdigit() else None)
        return device
    if isinstance(device, REAL_DEVICE) and device.type == "cuda":
        return active.torch_device(device.index)
    return device


def _routed_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A factory's keywords with ``device=`` mapped by :func:`map_device` (and ``pin_memory``
    dropped on a host-only device)."""
    if "device" in kwargs:
        kwargs["device"] = map_device(kwargs["device"])
    if kwargs.get("pin_memory"):
        active = devices.active()
        if active is not None and active.torch_type == "cpu":
            # page-locked memory only speeds copies to an accelerator, and a host-only torch
            # has no allocator for it (Megatron-LM's get_batch_on_this_cp_rank asks for it)
            kwargs["pin_memory"] = False
    return kwargs


def route_device(factory: Any) -> Any:
    """``factory`` with its ``device=`` keyword mapped by :func:`map_device`."""

    @functools.wraps(factory)
    def routed(*args: Any, **kwargs: Any) -> Any:
        return factory(*args, **_routed_kwargs(kwargs))

    return routed


def _route_torch_factory(name: str) -> Any:
    """torch's factory ``name``, as torch holds it at each call, with its device routed."""

    @functools.wraps(getattr(torch, name))
    def routed(*args: Any, **kwargs: Any) -> Any:
        return getattr(torch, name)(*args, **_routed_kwargs(kwargs))

    return routed


class _DeviceMeta(type):
    """``torch.device`` look-alike: constructing maps CUDA to the active device;
    isinstance works."""

    def __call__(cls, type: Any = None, index: Any = None) -> torch.device:  # noqa: A002
        if isinstance(index, REAL_DEVICE):  # torch.device("cuda", torch.cuda.current_device())
            return index
        if index is None and isinstance(type, str):
            mapped = map_device(type)
            return mapped if isinstance(mapped, REAL_DEVICE) else REAL_DEVICE(mapped)
        real = REAL_DEVICE(type) if index is None else REAL_DEVICE(type, index)
        return map_device(real)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, REAL_DEVICE)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, REAL_DEVICE)


class RoutedDevice(metaclass=_DeviceMeta):
    pass


class TorchNamespace(ModuleType):
    """What ``torch`` means inside a patched Megatron module.

    Its own attributes (the routed factories, ``device``, ``cuda`` and a subclass's public
    class attributes) answer first; every other name is torch's, read at each use.
    """

    #: public names defined on the class (``cuda``; a subclass's own are added to them)
    _class_names: frozenset[str] = frozenset({"cuda"})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._class_names = cls._class_names | {n for n in vars(cls) if not n.startswith("_")}

    def __init__(self) -> None:
        super().__init__("torch", "megatron-npu device-routed view of torch")
        for name in FACTORIES:
            setattr(self, name, _route_torch_factory(name))
        self.device = RoutedDevice

    @property
    def cuda(self) -> Any:
        active = devices.active()
        return active.accelerator if active is not None else torch.cuda

    def __getattribute__(self, name: str) -> Any:
        # a __getattribute__, not a __getattr__: a module's failed lookup before __getattr__
        # costs about 1.3 us, this about 0.15 us
        if name[:1] == "_":
            try:
                return ModuleType.__getattribute__(self, name)
            except AttributeError:
                return getattr(torch, name)
        own = ModuleType.__getattribute__(self, "__dict__")
        if name in own:
            return own[name]
        if name in type(self)._class_names:
            return ModuleType.__getattribute__(self, name)
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<megatron-npu torch namespace>"


#: The one instance shared by every patched module.
TORCH_NAMESPACE = TorchNamespace()
