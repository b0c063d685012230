"""The fused-RoPE entry points against what Megatron runs without Transformer Engine or Triton
(its unfused ``_apply_rotary_pos_emb_bshd``): the plain rotation at the rotary benchmark's shapes,
and multi-latent attention's query and key/value at DeepSeek-V3's head widths (q/k 128 + 64
rotated, v 128), where Megatron's own path is ``--no-rope-fusion``'s split, rotation and
concatenation."""

from __future__ import annotations

from typing import Any

import torch

from perf.case import BenchCase, Built, Cell, installed_of
from perf.cases.layers import _SEQ, ROTARY


def _stock_rotary() -> Any:
    """Megatron's own ``_apply_rotary_pos_emb_bshd`` of the installed release."""
    from megatron_npu import patcher
    from megatron_npu.registry import all_patches

    version = patcher.megatron_core_version()
    stock = next(
        p
        for p in all_patches()
        if p.target.endswith("._apply_rotary_pos_emb_bshd") and p.applies_to_version(version)
    )
    return patcher.original(stock)


def _build(cell: Cell) -> Built:
    s, b, n, d = (cell.shape[k] for k in ("seq", "batch", "heads", "head_dim"))
    t = (
        torch.randn(s, b, n, d, generator=torch.Generator().manual_seed(0))
        .to(cell.torch_dtype)
        .requires_grad_(True)
    )
    freqs = torch.randn(s, 1, 1, d, generator=torch.Generator().manual_seed(1))
    if cell.path == "megatron":  # no TE: Megatron's config refuses the fusion; unfused it is
        unfused = _stock_rotary()
        return Built(lambda: unfused(t, freqs), (t,))
    fused = installed_of(cell)
    return Built(lambda: fused(t, freqs), (t,))


ROTARY_FUSED = BenchCase(op="rotary-fused", shapes=ROTARY.shapes, build=_build)


#: DeepSeek-V3's MLA widths: q/k heads of 128 features plus 64 rotated, v heads of 128
_MLA_WIDTHS = {"qk_dim": 128, "emb_dim": 64, "v_dim": 128}
_MLA_SHAPES = {
    k: {"seq": s, "batch": 1, "heads": 16 if k == "full" else 4, **_MLA_WIDTHS}
    for k, s in _SEQ.items()
}


def _regrouped(unfused: Any) -> dict[str, bool]:
    """The keyword of ``unfused`` that asks for MLA's regrouping (0.19 renamed it)."""
    import inspect

    names = inspect.signature(unfused).parameters
    return {
        "mla_rotary_interleaved"
        if "mla_rotary_interleaved" in names
        else "multi_latent_attention": True
    }


def _mla_inputs(cell: Cell):
    s, b, n = (cell.shape[k] for k in ("seq", "batch", "heads"))
    qk, emb, v = (cell.shape[k] for k in ("qk_dim", "emb_dim", "v_dim"))
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(cell.torch_dtype).requires_grad_(True)

    angles = torch.arange(s, dtype=torch.float32).view(s, 1, 1, 1) * torch.rand(emb // 2)
    freqs = torch.cat((angles, angles), dim=-1)  # YaRN's emb [s, 1, 1, emb], fp32
    cos, sin = (f(freqs).to(cell.torch_dtype) for f in (torch.cos, torch.sin))
    return leaf(s, b, n, qk + emb), leaf(s, b, n, qk + v), leaf(s, b, 1, emb), freqs, cos, sin


def _mla_q(cell: Cell) -> Built:
    q, _, _, freqs, cos, sin = _mla_inputs(cell)
    qk, emb = cell.shape["qk_dim"], cell.shape["emb_dim"]
    if cell.path == "megatron":  # --no-rope-fusion: split, the regrouped rotation, cat
        unfused = _stock_rotary()

        def run():
            nope, pe = torch.split(q, [qk, emb], dim=-1)
            return torch.cat((nope, unfused(pe, freqs, **_regrouped(unfused))), dim=-1)

        return Built(run, (q,))
    fused = installed_of(cell)
    return Built(lambda: fused(q, cos, sin, qk, emb), (q,))


def _mla_kv(cell: Cell) -> Built:
    _, kv, k_pos_emb, freqs, cos, sin = _mla_inputs(cell)
    n, qk, emb, v = (cell.shape[k] for k in ("heads", "qk_dim", "emb_dim", "v_dim"))
    if cell.path == "megatron":  # --no-rope-fusion: split, rotate the shared head, expand, cat
        unfused = _stock_rotary()

        def run():
            k_nope, value = torch.split(kv, [qk, v], dim=-1)
            pe = unfused(k_pos_emb, freqs, **_regrouped(unfused))
            return torch.cat((k_nope, pe.expand(-1, -1, n, -1)), dim=-1), value

        return Built(run, (kv, k_pos_emb))
    fused = installed_of(cell)
    return Built(lambda: fused(kv, k_pos_emb, cos, sin, emb, qk, v), (kv, k_pos_emb))


MLA_ROPE_Q = BenchCase(op="mla-rope-q", shapes=_MLA_SHAPES, build=_mla_q)
MLA_ROPE_KV = BenchCase(op="mla-rope-kv", shapes=_MLA_SHAPES, build=_mla_kv)
