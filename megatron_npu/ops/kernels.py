"""Which torch_npu-like kernel module the op layer calls, if any.

The device layer sets this when the adaptor is applied: the real ``torch_npu`` on an Ascend NPU,
``megatron_npu.testing.torch_npu_emulation`` for ``npu-emulated``, and ``None`` (native torch
paths) on ``cpu`` and ``cuda``. Ops read it at call time, so re-applying for another device
switches every op at once.

**Kernels served natively** (``$MEGATRON_NPU_NATIVE_KERNELS=npu_rms_norm,...``, read when the
kernel module is bound): the op that would call one of them takes its native torch path instead,
on the same device, while its patch stays installed. It is the narrowest switch there is: where
switching a whole patch off leaves Megatron's stock code, which may not run in the user's
configuration (Megatron-LM's default ``persist_layer_norm`` asserts in the stock local norm),
serving one kernel natively still runs, and tells whether that kernel is what moves the numbers.
``megatron-npu locate`` uses it in its culprit search.
"""

from __future__ import annotations

import os
from types import ModuleType

NATIVE_ENV = "MEGATRON_NPU_NATIVE_KERNELS"

_kernels: ModuleType | None = None
_native: frozenset[str] = frozenset()


def native_kernels_from_environment() -> frozenset[str]:
    """The kernel names ``$MEGATRON_NPU_NATIVE_KERNELS`` lists; a name no adaptor patch calls is
    one named error (a misspelt kernel must not pass as a trial that changed nothing)."""
    from megatron_npu.registry import all_patches

    names = frozenset(n.strip() for n in os.environ.get(NATIVE_ENV, "").split(",") if n.strip())
    called = {k for p in all_patches() for k in p.npu_kernels}
    unknown = sorted(names - called)
    if unknown:
        raise ValueError(
            f"{NATIVE_ENV}: {', '.join(unknown)} is not a kernel the adaptor calls (it calls "
            f"{', '.join(sorted(called))})"
        )
    return names


def use_npu_kernels(module: ModuleType | None) -> None:
    """Route ops to ``module`` (a torch_npu-compatible namespace), or to native torch if None;
    the kernels ``$MEGATRON_NPU_NATIVE_KERNELS`` names stay native."""
    global _kernels, _native
    _native = native_kernels_from_environment() if module is not None else frozenset()
    _kernels = module


def npu_kernels(*names: str) -> ModuleType | None:
    """The torch_npu-compatible module an op calling the kernels ``names`` should use, or None
    for the native path (no kernel module, or one of ``names`` served natively)."""
    if _kernels is None or not _native.isdisjoint(names):
        return None
    return _kernels


def served_natively() -> frozenset[str]:
    """The kernels the op layer serves natively although the device has them."""
    return _native if _kernels is not None else frozenset()
