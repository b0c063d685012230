"""The adaptor's multi-latent attention RoPE (``rotary.fused-mla-*``) refuses what it does not
serve by name; its numerics are the ``mla-rope-*`` parity cases, its end-to-end curve
``tests/megatron_lm/test_pretrain_gpt.py::test_multi_latent_attention_trains_as_megatrons_unfused_code``."""

from __future__ import annotations

import pytest
import torch

from megatron_npu.patches.rope_fusion import (
    fused_apply_mla_rope_for_kv,
    fused_apply_mla_rope_for_q,
)


def _cache(rows: int, emb: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows, dtype=torch.float32).view(rows, 1, 1, 1) * torch.rand(emb // 2)
    freqs = torch.cat((angles, angles), dim=-1)
    return freqs.cos(), freqs.sin()


def test_packed_sequences_are_refused_by_name():
    cos, sin = _cache(8, 4)
    cu_seqlens = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match="fused_apply_mla_rope_for_q: packed sequences"):
        fused_apply_mla_rope_for_q(torch.randn(8, 2, 4), cos, sin, 0, 4, cu_seqlens)
    with pytest.raises(ValueError, match="fused_apply_mla_rope_for_kv: packed sequences"):
        fused_apply_mla_rope_for_kv(
            torch.randn(8, 2, 8), torch.randn(8, 1, 4), cos, sin, 4, 4, 4, cu_seqlens
        )


def test_interleaved_rotation_is_refused_by_name():
    cos, sin = _cache(8, 4)
    with pytest.raises(ValueError, match="rotary_interleaved is not supported"):
        fused_apply_mla_rope_for_q(torch.randn(8, 1, 2, 8), cos, sin, 4, 4, rotary_interleaved=True)


def test_release_0_13_positional_call_rotates_only_the_last_features():
    """megatron-core 0.13 calls ``(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens)``: the first
    ``qk_head_dim`` features pass through untouched, the others are rotated (norm kept)."""
    cos, sin = _cache(6, 8)
    t = torch.randn(6, 2, 3, 16 + 8)
    out = fused_apply_mla_rope_for_q(t, cos, sin, 16, 8, None)
    assert torch.equal(out[..., :16], t[..., :16])
    assert not torch.allclose(out[1:, ..., 16:], t[1:, ..., 16:])
    torch.testing.assert_close(out[..., 16:].norm(dim=-1), t[..., 16:].norm(dim=-1))
