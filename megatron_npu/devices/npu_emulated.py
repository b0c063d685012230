"""The NPU code path on the CPU: torch_npu calls go to the pure-torch emulation.

Tensors stay on the CPU with gloo process groups, but every op that would call a torch_npu kernel
calls :mod:`megatron_npu.testing.torch_npu_emulation` with the same arguments, so the adaptor's
NPU branch (layouts, mask polarity, window rules) runs in CI. Results are labelled
``npu-emulated``; they are never NPU results.
"""

from __future__ import annotations

from megatron_npu.devices.base import Device
from megatron_npu.devices.cpu import CpuAccelerator
from megatron_npu.devices.facts import NPU_EMULATED


class EmulatedNpuAccelerator(CpuAccelerator):
    name = NPU_EMULATED


def make_device() -> Device:
    from megatron_npu.devices import torch_npu_schema
    from megatron_npu.testing import torch_npu_emulation

    return Device.of(
        NPU_EMULATED,
        accelerator=EmulatedNpuAccelerator(),
        kernels=torch_npu_emulation,
        kernels_source=f"the emulation of torch_npu {torch_npu_schema.pinned_version()}",
    )
