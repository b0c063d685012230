"""Which torch_npu-like kernel module the op layer calls, if any.

The device layer sets this when the adaptor is applied: the real ``torch_npu`` on an Ascend NPU,
``megatron_npu.testing.torch_npu_emulation`` for ``npu-emulated``, and ``None`` (native torch
paths) on ``cpu`` and ``cuda``. Ops read it at call time, so re-applying for another device
switches every op at once.
"""

from __future__ import annotations

from types import ModuleType

_kernels: ModuleType | None = None


def use_npu_kernels(module: ModuleType | None) -> None:
    """Route ops to ``module`` (a torch_npu-compatible namespace), or to native torch if None."""
    global _kernels
    _kernels = module


def npu_kernels() -> ModuleType | None:
    """The torch_npu-compatible module ops should call, or None for the native path."""
    return _kernels
