"""What every device backend provides to the adaptor."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from megatron_npu.devices.facts import DeviceFacts, facts


@dataclass(frozen=True)
class Device:
    """One place Megatron can run.

    ``name`` is what reports show (``cpu``, ``npu``, ``npu-emulated``, ``cuda``); ``torch_type`` is
    the torch device type tensors live on; ``accelerator`` answers what Megatron asks of
    ``torch.cuda``; ``kernels`` is the torch_npu-compatible module the op layer calls (None means
    native torch ops). A registry patch whose ``npu_kernels`` are not all in ``kernels`` is
    refused on the device (:func:`missing_kernels`).
    """

    name: str
    torch_type: str
    dist_backend: str
    accelerator: Any
    kernels: ModuleType | None = None
    emulated: bool = False
    #: what the kernel module is, for messages (``torch_npu 2.13.0`` on ``npu``)
    kernels_source: str | None = None

    @classmethod
    def of(
        cls,
        name: str,
        accelerator: Any,
        kernels: ModuleType | None = None,
        kernels_source: str | None = None,
    ) -> Device:
        """Device ``name`` with its torch type, backend and emulation flag from its facts."""
        known = facts(name)
        return cls(
            name=known.name,
            torch_type=known.torch_type,
            dist_backend=known.dist_backend,
            accelerator=accelerator,
            kernels=kernels,
            emulated=known.emulated,
            kernels_source=kernels_source,
        )

    @property
    def facts(self) -> DeviceFacts:
        """The fixed facts of this device's name (:mod:`megatron_npu.devices.facts`)."""
        return facts(self.name)

    def missing_kernels(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` the device's kernel module does not provide (none without one)."""
        if self.kernels is None:
            return []
        return [name for name in names if not callable(getattr(self.kernels, name, None))]

    def torch_device(self, index: int | None = None) -> torch.device:
        if self.torch_type == "cpu" or index is None:
            return torch.device(self.torch_type)
        return torch.device(self.torch_type, index)

    def describe(self) -> str:
        note = " (NPU code path emulated on CPU; not an NPU result)" if self.emulated else ""
        return (
            f"{self.name}: tensors on {self.torch_type}, "
            f"process groups on {self.dist_backend}{note}"
        )


class NoNvtx:
    """``torch.cuda.nvtx`` for a device without an NVTX consumer (cpu, npu): every call is a
    no-op and ``range`` still nests as a context manager."""

    @staticmethod
    def range_push(msg: str) -> int:
        return 0

    @staticmethod
    def range_pop() -> int:
        return 0

    @staticmethod
    def mark(msg: str) -> None:
        return None

    @staticmethod
    @contextlib.contextmanager
    def range(msg: str, *args: Any, **kwargs: Any):
        yield
