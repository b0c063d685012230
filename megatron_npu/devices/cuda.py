"""Native CUDA, untouched: the comparison baseline (the "competitor" row of the reports)."""

from __future__ import annotations

import torch

from megatron_npu.devices.base import Device
from megatron_npu.devices.facts import CUDA


def make_device() -> Device:
    if not torch.cuda.is_available():
        from megatron_npu.devices.errors import DeviceUnavailableError

        raise DeviceUnavailableError(
            "device 'cuda' was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
            "use MEGATRON_NPU_DEVICE=cpu or run on a GPU machine"
        )
    return Device.of(CUDA, torch.cuda)
