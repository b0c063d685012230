"""What every device backend provides to the adaptor."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


@dataclass(frozen=True)
class Device:
    """One place Megatron can run.

    ``name`` is what reports show (``cpu``, ``npu``, ``npu-emulated``, ``cuda``); ``torch_type`` is
    the torch device type tensors live on; ``accelerator`` answers what Megatron asks of
    ``torch.cuda``; ``kernels`` is the torch_npu-compatible module the op layer calls (None means
    native torch ops).
    """

    name: str
    torch_type: str
    dist_backend: str
    accelerator: Any
    kernels: ModuleType | None = None
    emulated: bool = False

    def torch_device(self, index: int | None = None) -> torch.device:
        if self.torch_type == "cpu" or index is None:
            return torch.device(self.torch_type)
        return torch.device(self.torch_type, index)

    def describe(self) -> str:
        note = " (NPU code path emulated on CPU; not an NPU result)" if self.emulated else ""
        return f"{self.name}: tensors on {self.torch_type}, process groups on {self.dist_backend}{note}"
