"""Each ``torch-namespace:*`` patch routes its Megatron module's CUDA assumptions to the active
device (the exemption of every entry without a parity case points here): inside the module,
``torch.cuda.current_device()`` answers and ``torch.empty(..., device="cuda")`` lands on the
CPU. With the entry disabled (``MEGATRON_NPU_DISABLE=<id>``, as the coverage gate runs it) the
module sees the real torch and a CUDA-less machine raises."""

from __future__ import annotations

import importlib

import pytest

from megatron_npu.patches.device_namespace import PATCHES

_IDS = [p.id for p in PATCHES]


@pytest.mark.parametrize("patch_id", _IDS)
def test_module_torch_routes_cuda_to_the_active_device(patch_id, cpu_adaptor):
    patch = next(p for p in PATCHES if p.id == patch_id)
    module = importlib.import_module(patch.target.rpartition(".")[0])
    routed = module.torch
    device = routed.cuda.current_device()
    buffer = routed.empty(2, device="cuda")
    assert buffer.device.type == "cpu", (patch_id, buffer.device)
    assert routed.device("cuda", device).type == "cpu"
