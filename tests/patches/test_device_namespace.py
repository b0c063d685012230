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


def test_module_torch_reads_what_torch_holds_at_each_use(cpu_adaptor):
    """The routed view keeps no copy of torch's attributes: the patched products, and torch's
    own once they are put back (the parity references multiply with those), are what the module
    calls. A kept first copy made a reference of Megatron's attention call the adaptor's
    16-bit product after a test had run that attention with the product installed."""
    import torch
    from megatron_npu.parity.harness import torch_products

    # Megatron's unfused attention where this release routes it, else the first routed module
    attention = "megatron.core.transformer.dot_product_attention"
    name = attention if f"{attention}.torch" in {p.target for p in PATCHES} else PATCHES[0].target
    module = importlib.import_module(name.removesuffix(".torch"))
    routed = module.torch
    assert routed is not torch, f"{module.__name__}'s torch is not the routed view"
    patched = torch.baddbmm
    assert routed.baddbmm is patched  # the matmul entry's 16-bit product, installed on cpu
    with torch_products():
        own = torch.baddbmm
        assert own is not patched
        assert routed.baddbmm is own
    assert routed.baddbmm is patched


def test_module_torch_factories_call_what_torch_holds_at_each_use(cpu_adaptor, monkeypatch):
    import torch

    calls = []

    def zeros(*args, **kwargs):
        calls.append(kwargs)
        return "made"

    module = importlib.import_module(PATCHES[0].target.rpartition(".")[0])
    monkeypatch.setattr(torch, "zeros", zeros)
    assert module.torch.zeros(2, device="cuda") == "made"
    assert calls and calls[0]["device"].type == "cpu", calls
