"""``apply_rope_fusion`` (Megatron-LM's default, ``--no-rope-fusion`` turns it off) without
Transformer Engine or Triton.

Megatron's ``TransformerConfig`` refuses the option when TE's ``fused_apply_rotary_pos_emb`` did
not import (``rope_utils`` then binds it to None), and ``apply_rotary_pos_emb`` calls it for the
``sbhd`` layout with ``mscale == 1``. The entry installs the adaptor's rotary op under that name:
the same ``rotary_mul`` (``npu_rotary_mul`` on the NPU) the unfused path is routed to.

Multi-latent attention with YaRN (``MLATransformerConfig``'s default ``rope_type``) takes the
option through its own Triton kernels, ``fused_apply_mla_rope_for_q`` / ``_for_kv``, which need a
CUDA device. The ``rotary.fused-mla-*`` entries put the same rotation in their place: the last
``emb_dim`` features of each query head, and the one shared ``k_pos_emb`` head appended to every
key head, with even features regrouped before the half rotation, against the cached cos/sin
Megatron hands over (YaRN's scale folded in). The packed (THD) layout is refused by name, as the
adaptor's attention refuses packed sequences.
"""

from __future__ import annotations

import torch

from megatron_npu.ops.rotary import regrouped_rotary
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


def _sbhd_rows(op: str, t: torch.Tensor, cu_seqlens, interleaved: bool) -> slice:
    """cos rows of ``t``'s positions (``[s, b, ...]``: this rank's rows, which are the first
    ``s`` of Megatron's cache, itself cut to the rank's context-parallel chunks)."""
    if cu_seqlens is not None:
        raise ValueError(
            f"{op}: packed sequences (THD) are not served by the adaptor; "
            "run multi-latent attention without packed sequences"
        )
    if interleaved:  # Megatron's own kernel asserts the same
        raise ValueError(f"{op}: rotary_interleaved is not supported")
    return slice(0, t.shape[0])


def fused_apply_mla_rope_for_q(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_head_dim: int,
    emb_dim: int,
    cu_seqlens_q=None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
) -> torch.Tensor:
    """Megatron's signature: ``t`` ``[s, b, n, qk_head_dim + emb_dim]``, ``cos``/``sin``
    ``[>= s, 1, 1, emb_dim]`` -> ``t`` with its last ``emb_dim`` features rotated (a new tensor;
    Megatron uses the returned one)."""
    rows = _sbhd_rows("fused_apply_mla_rope_for_q", t, cu_seqlens_q, rotary_interleaved)
    nope, pe = t.split([qk_head_dim, emb_dim], dim=-1)
    return torch.cat((nope, regrouped_rotary(pe, cos[rows], sin[rows])), dim=-1)


def fused_apply_mla_rope_for_kv(
    kv: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv=None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's signature: ``kv`` ``[s, b, n, k_dim + v_dim]``, ``k_pos_emb``
    ``[s, b, 1, emb_dim]`` -> key ``[s, b, n, k_dim + emb_dim]`` (the rotated ``k_pos_emb`` on
    every head) and value ``[s, b, n, v_dim]``."""
    rows = _sbhd_rows("fused_apply_mla_rope_for_kv", kv, cu_seqlens_kv, rotary_interleaved)
    s, b, heads = kv.shape[:3]
    k_nope, value = kv.split([k_dim, v_dim], dim=-1)
    pe = regrouped_rotary(k_pos_emb.reshape(s, b, 1, emb_dim), cos[rows], sin[rows])
    key = torch.cat((k_nope, pe.expand(s, b, heads, emb_dim)), dim=-1)
    return key, value.contiguous()


_MLA = "megatron.core.transformer.multi_latent_attention"

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
    Patch(
        id="rotary.fused-mla-q",
        target=f"{_MLA}.fused_apply_mla_rope_for_q",
        replacement=fused_apply_mla_rope_for_q,
        reason="multi-latent attention's fused YaRN RoPE on the query (a Triton kernel for "
        "CUDA) -> the regrouped rotation in torch",
        versions=">=0.13",
        # 0.13 wraps the kernel in experimental_fn ((*args, **kwargs)) and has no cp_rank /
        # cp_size; the replacement takes every release's call
        check_signature=False,
        parity="megatron_npu.parity.cases.mla_rope:MLA_ROPE_Q",
        benchmark="perf.cases.rope_fusion:MLA_ROPE_Q",
    ),
    Patch(
        id="rotary.fused-mla-kv",
        target=f"{_MLA}.fused_apply_mla_rope_for_kv",
        replacement=fused_apply_mla_rope_for_kv,
        reason="multi-latent attention's fused YaRN RoPE splitting kv and appending the rotated "
        "shared key head (a Triton kernel for CUDA) -> the same in torch",
        versions=">=0.13",
        # 0.13 wraps the kernel in experimental_fn ((*args, **kwargs)) and has no cp_rank /
        # cp_size; the replacement takes every release's call
        check_signature=False,
        parity="megatron_npu.parity.cases.mla_rope:MLA_ROPE_KV",
        benchmark="perf.cases.rope_fusion:MLA_ROPE_KV",
    ),
]
