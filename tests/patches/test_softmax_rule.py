"""The patched ``FusedScaleMaskSoftmax.is_kernel_available`` follows the NPU kernel's documented
limits (the ``softmax.is-kernel-available`` patch's parity exemption points here).

``npu_scaled_masked_softmax`` takes fp16/bf16 scores whose query and key lengths are each in
32..4096 and divisible by 32; fusion must have been asked for (``--masked-softmax-fusion``);
fp32 scores and sliding-window attention (whose mask the op cannot build) always take Megatron's
torch path. Megatron's CUDA-only conditions (``b * np % 4``, batch-per-block) no longer apply.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_npu

MIN, MAX, MULTIPLE = 32, 4096, 32
LENGTHS = [1, 16, 31, 32, 33, 48, 64, 96, 2048, 4064, 4095, 4096, 4097, 4128, 8192]


def _softmax(dtype, fusion=True, causal=True, window_size=None):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(
        input_in_fp16=dtype == torch.float16,
        input_in_bf16=dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.padding,
        scaled_masked_softmax_fusion=fusion,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
        window_size=window_size,
    )


def _documented(dtype, fusion, sq, sk):
    in_range = all(MIN <= s <= MAX and s % MULTIPLE == 0 for s in (sq, sk))
    return fusion and dtype in (torch.float16, torch.bfloat16) and in_range


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rule_on_the_limits(cpu_adaptor, dtype, fusion, causal):
    module = _softmax(dtype, fusion=fusion, causal=causal)
    for sq in LENGTHS:
        for sk in LENGTHS:
            mask = (
                None if causal else torch.zeros(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, sq, sk)
            )
            got = module.is_kernel_available(mask, 1, 1, sq, sk)
            assert got is _documented(dtype, fusion, sq, sk), (dtype, fusion, causal, sq, sk)


def test_rule_on_any_shape(cpu_adaptor):
    @settings(max_examples=300, deadline=None)
    @given(
        dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
        fusion=st.booleans(),
        b=st.integers(1, 9),
        np=st.integers(1, 9),
        sq=st.integers(1, 5000),
        sk=st.integers(1, 5000),
    )
    def check(dtype, fusion, b, np, sq, sk):
        got = _softmax(dtype, fusion=fusion).is_kernel_available(None, b, np, sq, sk)
        assert got is _documented(dtype, fusion, sq, sk)

    check()


def test_cuda_only_conditions_are_dropped(cpu_adaptor):
    # b * np = 1 is not a multiple of 4: Megatron's CUDA rule refuses, the NPU kernel does not
    assert _softmax(torch.bfloat16).is_kernel_available(None, 1, 1, 32, 32) is True
    assert _softmax(torch.float16, causal=False).is_kernel_available(None, 1, 3, 64, 4096) is True


def test_fp32_never_fuses(cpu_adaptor):
    module = _softmax(torch.float32)
    assert not any(module.is_kernel_available(None, 4, 4, s, s) for s in (32, 64, 1024, 4096))


def test_sliding_window_never_fuses(cpu_adaptor):
    module = _softmax(torch.bfloat16, window_size=(16, 0))
    assert module.is_kernel_available(None, 4, 4, 64, 64) is False


def test_forward_dispatches_by_the_rule(cpu_adaptor, monkeypatch):
    """Megatron's forward takes the fused op exactly when the rule says so."""
    calls = []
    module = _softmax(torch.bfloat16)
    original = type(module).forward_fused_softmax

    def spy(self, x, mask):
        calls.append(tuple(x.shape))
        return original(self, x, mask)

    monkeypatch.setattr(type(module), "forward_fused_softmax", spy)
    for sq in (16, 32, 48, 64):
        x = torch.randn(1, 2, sq, sq).to(torch.bfloat16)
        probs = module(x, None)
        torch.testing.assert_close(probs.float().sum(-1), torch.ones(1, 2, sq), rtol=0, atol=2e-2)
    assert calls == [(1, 2, 32, 32), (1, 2, 64, 64)]


def test_restore_puts_back_megatron_rule():
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    stock = FusedScaleMaskSoftmax.is_kernel_available
    megatron_npu.apply("cpu")
    try:
        assert FusedScaleMaskSoftmax.is_kernel_available is not stock
    finally:
        megatron_npu.restore()
    assert FusedScaleMaskSoftmax.is_kernel_available is stock
