"""The emulation can stand in for torch_npu and says what it is."""

from __future__ import annotations

import importlib
import sys

import pytest

from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import native_kernels_around_each_test, npu_emulated  # noqa: F401

# the emulation's signatures against torch_npu's own schemas: tests/devices/test_torch_npu_schema.py


def test_installs_as_torch_npu_and_labels_itself():
    saved = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = emulation
    try:
        torch_npu = importlib.import_module("torch_npu")
        assert torch_npu is emulation
        assert all(hasattr(torch_npu, name) for name in emulation.KERNELS)
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
    for name in emulation.KERNELS:
        real = getattr(emulation, name)
        monkeypatch.setattr(
            emulation, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k)
        )
    x = torch.randn(4, 2, 8)
    attention.fused_attention(x, x, x, head_num=2, causal=True)
    norm.rms_norm(x, torch.ones(8))
    swiglu.swiglu(x)
    gelu.bias_gelu(x, torch.zeros(8))
    rotary.rotary_mul(x[None], torch.ones(1, 1, 2, 8), torch.zeros(1, 1, 2, 8))
    softmax.scaled_masked_softmax(torch.randn(1, 1, 32, 32), causal=True)
    p = [torch.randn(3)]
    adamw.adamw_step_(p, [torch.randn(3)], [torch.zeros(3)], [torch.zeros(3)], step=1, lr=0.1)
    assert calls == [
        "npu_fusion_attention",
        "npu_rms_norm",
        "npu_swiglu",
        "npu_gelu",
        "npu_rotary_mul",
        "npu_scaled_masked_softmax",
        "npu_apply_adam_w",
    ]


# ---------------------------------------------------------------- documented input limits


def test_softmax_fixed_triu_mask_builds_the_causal_mask_itself():
    """``fixed_triu_mask=True`` (documented, not reserved): the kernel ignores the mask's
    values and masks the upper triangle; checked against msprobe's CPU bench function given
    the explicit triangle (its own ``fixed_triu_mask=True`` branch calls ``torch.triu(...,
    k=1)``, which torch rejects)."""
    import torch
    from msprobe.pytorch.bench_functions.scaled_mask_softmax import (
        npu_scaled_masked_softmax as msprobe_softmax,
    )

    x = torch.randn(2, 3, 64, 64)
    ignored = torch.zeros(2, 1, 64, 64, dtype=torch.bool)
    got = emulation.npu_scaled_masked_softmax(x, ignored, 0.5, fixed_triu_mask=True)
    explicit = torch.ones(64, 64, dtype=torch.bool).triu(1)
    assert torch.equal(got, emulation.npu_scaled_masked_softmax(x, explicit, 0.5))
    want = msprobe_softmax(x, explicit, 0.5, False)
    torch.testing.assert_close(got, want)
    assert float(got[..., 0, 1:].abs().max()) < 1e-30  # the first query sees only key 0


def test_softmax_fully_masked_row_is_uniform_not_dead():
    import torch

    mask = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    mask[..., 5, :] = True
    out = emulation.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32), mask)
    torch.testing.assert_close(out[0, 0, 5], torch.full((32,), 1 / 32))


def _fa(sq, skv, mask, **kwargs):
    import torch

    q = torch.randn(1, sq, 16)
    kv = torch.randn(1, skv, 16)
    return emulation.npu_fusion_attention(q, kv, kv, 2, "BSH", atten_mask=mask, **kwargs)[0]


def test_fusion_attention_dead_rows_only_where_documented():
    import torch

    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2] = True  # query 2 sees nothing
    with pytest.raises(ValueError, match="inner_precise=2"):
        _fa(4, 4, mask)
    out = _fa(4, 4, mask, inner_precise=2)  # invalid-row computation: the row outputs 0
    assert torch.equal(out[0, 2], torch.zeros(16))
    compressed = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    out = _fa(6, 3, compressed, sparse_mode=3)  # Sq > Skv: the kernel finds the rows itself
    assert torch.equal(out[0, :3], torch.zeros(3, 16)) and bool(out[0, 3:].abs().sum() > 0)


def _rotary(x_shape, r_shape, mode="half", value=0.5, grad=False):
    import torch

    r = torch.full(r_shape, value, requires_grad=grad)
    return emulation.npu_rotary_mul(torch.randn(x_shape), r, r, rotary_mode=mode)


def test_rotary_r1_r2_must_lie_in_minus_one_one():
    _rotary((2, 4, 3, 8), (2, 1, 1, 8), value=1.0)
    with pytest.raises(ValueError, match=r"r1 values must lie in \[-1, 1\]"):
        _rotary((2, 4, 3, 8), (2, 1, 1, 8), value=1.3)


@pytest.mark.parametrize(
    ("x_shape", "r_shape", "mode", "ok"),
    [
        ((2, 3, 5, 8), (1, 1, 5, 8), "half", True),  # BNSD x, 11SD
        ((2, 3, 5, 8), (2, 1, 5, 8), "half", True),  # BNSD x, B1SD
        ((5, 2, 3, 8), (5, 2, 1, 8), "half", True),  # SBND x, SB1D (per-batch frequencies)
        ((5, 2, 3, 8), (5, 2, 1, 8), "interleave", False),  # interleave: 11SD/1S1D/S11D only
        ((5, 2, 3, 8), (1, 2, 3, 8), "half", False),  # 1BND is no documented layout
        ((5, 2, 3, 8), (5, 1, 1, 4), "half", False),  # not the full D
    ],
)
def test_rotary_layouts(x_shape, r_shape, mode, ok):
    if ok:
        _rotary(x_shape, r_shape, mode)
    else:
        with pytest.raises(ValueError, match="npu_rotary_mul: r1/r2"):
            _rotary(x_shape, r_shape, mode)


def test_rotary_batch_and_head_limits():
    with pytest.raises(ValueError, match=r"B, N < 1000"):
        _rotary((1, 1000, 2, 4), (1, 1, 2, 4))  # BNSD x with N = 1000
    with pytest.raises(ValueError, match=r"B \* N < 1000"):
        _rotary((2, 40, 25, 4), (2, 1, 1, 4), mode="interleave")  # SBND: B*N = 1000
    _rotary((2, 40, 25, 4), (2, 1, 1, 4))  # half mode: B, N < 1000 each is enough
    with pytest.raises(ValueError, match=r"B \* N <= 1024"):
        _rotary((2, 40, 26, 4), (2, 1, 1, 4), grad=True)  # r grads: B*N = 1040


def test_rms_norm_gamma_dtype_rule():
    import torch

    x = torch.randn(4, 8, dtype=torch.float16)
    emulation.npu_rms_norm(x, torch.ones(8, dtype=torch.float16))
    emulation.npu_rms_norm(x, torch.ones(8))  # fp32 gamma: the mixed-precision form
    with pytest.raises(TypeError, match="gamma dtype bfloat16 must equal x dtype float16"):
        emulation.npu_rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
