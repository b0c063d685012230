"""Parity of the fused-RoPE entry point (``apply_rope_fusion``, Megatron-LM's default) that the
adaptor provides in place of Transformer Engine's ``fused_apply_rotary_pos_emb``.

Megatron calls it only for the ``sbhd`` layout with ``mscale == 1`` and without multi-latent
attention's regrouping (its other cases take the unfused function), so the examples are
:mod:`megatron_npu.parity.cases.rotary`'s with those fixed; half and interleaved rotation, partial
rotary dims and per-batch frequencies are all drawn. The reference is the same plain-torch statement
of Megatron's rotation as the unfused case's.
"""

from __future__ import annotations

from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases import rotary
from megatron_npu.parity.cases._common import grads


def _run(ctx: Context, inputs):
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    t = ctx.tensor(inputs["t"], grad=True)
    freqs = inputs["freqs"].to(device=ctx.device, dtype=torch.float32)
    out = rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=ctx.params["interleaved"])
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), t=t)}


def _fused_only(params: dict) -> dict:
    return {**params, "mla": False, "mscale": 1.0}


ROTARY_FUSED = ParityCase(
    name="rotary-fused",
    params=rotary._params().map(_fused_only),
    make_inputs=rotary._inputs,
    run=_run,
    reference=rotary._reference,
    compares="rotated t [s, b, np, hn] (pass-through features included) and grad of t",
    reference_kind=rotary.ROTARY_BSHD.reference_kind,
    edge_cases=tuple(e for e in (_fused_only(e) for e in rotary.ROTARY_BSHD.edge_cases)),
)
