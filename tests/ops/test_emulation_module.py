"""The emulation can stand in for torch_npu and says what it is."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import native_kernels_around_each_test, npu_emulated  # noqa: F401

# parameter names and defaults of the torch_npu schemas (REFERENCE.md section 1)
SIGNATURES = {
    "npu_fusion_attention": (
        "query, key, value, head_num, input_layout, pse=None, padding_mask=None, "
        "atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647, "
        "next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None, "
        "actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False"
    ),
    "npu_rms_norm": "x, gamma, epsilon=1e-06",
    "npu_swiglu": "x, dim=-1",
    "npu_rotary_mul": "input, r1, r2, rotary_mode='half'",
    "npu_scaled_masked_softmax": "x, mask, scale=1.0, fixed_triu_mask=False",
    "npu_fast_gelu": "input",
    "npu_gelu": "input, approximate='none'",
    "npu_apply_adam_w": (
        "beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, "
        "max_grad_norm, amsgrad, maximize, *, out"
    ),
}


def test_signatures_match_torch_npu():
    for name, expected in SIGNATURES.items():
        assert str(inspect.signature(getattr(emulation, name))) == f"({expected})", name


def test_installs_as_torch_npu_and_labels_itself():
    saved = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = emulation
    try:
        torch_npu = importlib.import_module("torch_npu")
        assert torch_npu is emulation
        assert all(hasattr(torch_npu, name) for name in SIGNATURES)
    finally:
        if saved is None:
            sys.modules.pop("torch_npu")
        else:
            sys.modules["torch_npu"] = saved
    assert emulation.DEVICE_LABEL == "npu-emulated" and emulation.IS_EMULATION
    doc = emulation.__doc__
    assert "EMULATION" in doc and "npu-emulated" in doc and "never ``npu``" in doc


@pytest.mark.usefixtures("npu_emulated")
def test_public_ops_route_to_the_installed_kernels(monkeypatch):
    """With the emulation installed (fixture), every public op with an NPU kernel calls it."""
    import torch

    from megatron_npu.ops import adamw, attention, gelu, norm, rotary, softmax, swiglu

    calls = []
    for name in SIGNATURES:
        real = getattr(emulation, name)
        monkeypatch.setattr(emulation, name,
                            lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    x = torch.randn(4, 2, 8)
    attention.fused_attention(x, x, x, head_num=2, causal=True)
    norm.rms_norm(x, torch.ones(8))
    swiglu.swiglu(x)
    gelu.bias_gelu(x, torch.zeros(8))
    rotary.rotary_mul(x[None], torch.ones(1, 1, 2, 8), torch.zeros(1, 1, 2, 8))
    softmax.scaled_masked_softmax(torch.randn(1, 1, 32, 32), causal=True)
    p = [torch.randn(3)]
    adamw.adamw_step_(p, [torch.randn(3)], [torch.zeros(3)], [torch.zeros(3)], step=1, lr=0.1)
    assert calls == ["npu_fusion_attention", "npu_rms_norm", "npu_swiglu", "npu_gelu",
                     "npu_rotary_mul", "npu_scaled_masked_softmax", "npu_apply_adam_w"]
