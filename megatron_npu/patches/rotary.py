"""Megatron's rotary embedding (bshd layout) -> ``npu_rotary_mul`` / the native op."""

from __future__ import annotations

import warnings

import torch

from megatron_npu.ops.rotary import rotary_mul, rotate
from megatron_npu.registry import Patch


def _apply_rotary_pos_emb_bshd(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` features of ``t`` (``[s, b, np, hn]``)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if multi_latent_attention:
        t_rot = torch.cat((t_rot[..., 0::2], t_rot[..., 1::2]), dim=-1)
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    mode = "interleave" if rotary_interleaved else "half"
    if cos.dim() == 4 and cos.shape[1] == 1 and cos.shape[2] == 1 and abs(mscale) <= 1.0:
        # [s, 1, 1, d]: the S11D broadcast layout the kernel accepts in both modes; the kernel
        # takes r1/r2 only in [-1, 1], so a YaRN mscale > 1 keeps Megatron's formula
        out = rotary_mul(t_rot, cos, sin, rotary_mode=mode)
    else:  # per-batch frequencies or mscale > 1: Megatron's formula, in fp32 like the kernel
        # (cos/sin already rounded to t's dtype as Megatron does; one rounding at the end)
        xf = t_rot.float()
        out = (xf * cos.float() + rotate(xf, mode) * sin.float()).to(t.dtype)
    return torch.cat((out, t_pass), dim=-1) if t_pass.numel() else out


def _apply_rotary_pos_emb_bshd_mla_flag(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    multi_latent_attention: bool | None = None,
) -> torch.Tensor:
    """0.19's signature: the MLA regrouping is ``mla_rotary_interleaved``; the old
    ``multi_latent_attention`` keyword still wins when given, with Megatron's own warning."""
    if multi_latent_attention is not None:
        warnings.warn(
            "multi_latent_attention is deprecated. Please use mla_rotary_interleaved instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        mla_rotary_interleaved = multi_latent_attention
    return _apply_rotary_pos_emb_bshd(
        t,
        freqs,
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=mla_rotary_interleaved,
        mscale=mscale,
    )


PATCHES = [
    Patch(
        id="rotary.apply-bshd",
        target="megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",
        replacement=_apply_rotary_pos_emb_bshd,
        reason="--position-embedding-type rope through npu_rotary_mul (half / interleave)",
        versions=">=0.13,<0.19",
        parity="megatron_npu.parity.cases.rotary:ROTARY_BSHD",
        benchmark="perf.cases.layers:ROTARY",
        npu_kernels=("npu_rotary_mul",),
    ),
    Patch(
        id="rotary.apply-bshd-mla-flag",
        target="megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",
        replacement=_apply_rotary_pos_emb_bshd_mla_flag,
        reason="the same rotary op, with 0.19's mla_rotary_interleaved parameter",
        versions=">=0.19",
        parity="megatron_npu.parity.cases.rotary:ROTARY_BSHD",
        benchmark="perf.cases.layers:ROTARY",
        npu_kernels=("npu_rotary_mul",),
    ),
]
