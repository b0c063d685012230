"""Megatron's sliding-window attention (``config.window_size``) on the fused path: the band
Megatron's own softmax applies, not plain causal attention."""

from __future__ import annotations

import pytest
import torch
from megatron_npu.parity.cases._common import (
    fused_attention_settings,
    megatron_config,
    megatron_parallel,
)

import megatron_npu
from megatron_npu.ops import settings


@pytest.mark.parametrize("device", ["cpu", "npu-emulated"])
@pytest.mark.parametrize("window, skip_freq", [((3, 0), None), ((5, 2), None), ((2, 0), 2)])
def test_fused_attention_keeps_megatrons_sliding_window(device, window, skip_freq):
    """Megatron's unfused DotProductAttention with ``window_size`` (its torch softmax builds the
    band mask) and the fused path (``--use-flash-attn``) give the same context in fp32, for a
    causal band, a band that reaches ahead, and windows on every second layer only."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    megatron_npu.apply(device)
    try:
        with megatron_parallel():
            options = {"window_attn_skip_freq": skip_freq} if skip_freq else {}
            config = megatron_config(
                hidden_size=16,
                num_attention_heads=2,
                attention_dropout=0.0,
                masked_softmax_fusion=False,
                window_size=window,
                **options,
            )
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(12, 2, 2, 8, generator=gen) for _ in range(3))
            for layer_number in (1, 2):
                attention = DotProductAttention(config, layer_number, AttnMaskType.causal, "self")
                with fused_attention_settings(use_flash_attn=False):
                    unfused = attention(q, k, v, None, AttnMaskType.causal)
                with fused_attention_settings(use_flash_attn=True):
                    fused = attention(q, k, v, None, AttnMaskType.causal)
                torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
                plain = settings.fused_attention()
                assert not plain.use_flash_attn  # the settings were put back
    finally:
        megatron_npu.restore()
