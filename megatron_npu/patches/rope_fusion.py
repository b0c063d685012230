"""``apply_rope_fusion`` (Megatron-LM's default, ``--no-rope-fusion`` turns it off) without
Transformer Engine.

Megatron's ``TransformerConfig`` refuses the option when TE's ``fused_apply_rotary_pos_emb`` did
not import (``rope_utils`` then binds it to None), and ``apply_rotary_pos_emb`` calls it for the
``sbhd`` layout with ``mscale == 1``. The entry installs the adaptor's rotary op under that name:
the same ``rotary_mul`` (``npu_rotary_mul`` on the NPU) the unfused path is routed to.
"""

from __future__ import annotations

import torch

from megatron_npu.patches.rotary import _apply_rotary_pos_emb_bshd
from megatron_npu.registry import Patch


def fused_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    transpose_output_memory: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """TE's signature (``sbhd`` layout: ``t`` ``[s, b, np, hn]``, ``freqs`` ``[s, 1, 1, rot]``);
    ``transpose_output_memory`` is a memory-layout hint with no effect on values."""
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


PATCHES = [
    Patch(
        id="rotary.fused-apply",
        target="megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb",
        replacement=fused_apply_rotary_pos_emb,
        reason="TE's fused RoPE (apply_rope_fusion) -> npu_rotary_mul / the native op",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.rotary_fused:ROTARY_FUSED",
        benchmark="perf.cases.rope_fusion:ROTARY_FUSED",
        npu_kernels=("npu_rotary_mul",),
    ),
]
