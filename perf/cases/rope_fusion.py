"""The fused-RoPE entry point against what Megatron runs without Transformer Engine (its unfused
``_apply_rotary_pos_emb_bshd``), at the rotary benchmark's shapes."""

from __future__ import annotations

import torch

from perf.case import BenchCase, Built, Cell, installed_of
from perf.cases.layers import ROTARY


def _build(cell: Cell) -> Built:
    from megatron_npu import patcher
    from megatron_npu.registry import all_patches

    s, b, n, d = (cell.shape[k] for k in ("seq", "batch", "heads", "head_dim"))
    t = (
        torch.randn(s, b, n, d, generator=torch.Generator().manual_seed(0))
        .to(cell.torch_dtype)
        .requires_grad_(True)
    )
    freqs = torch.randn(s, 1, 1, d, generator=torch.Generator().manual_seed(1))
    if cell.path == "megatron":  # no TE: Megatron's config refuses the fusion; unfused it is
        version = patcher.megatron_core_version()
        stock = next(
            p
            for p in all_patches()
            if p.target.endswith("._apply_rotary_pos_emb_bshd") and p.applies_to_version(version)
        )
        unfused = patcher.original(stock)
        return Built(lambda: unfused(t, freqs), (t,))
    fused = installed_of(cell)
    return Built(lambda: fused(t, freqs), (t,))


ROTARY_FUSED = BenchCase(op="rotary-fused", shapes=ROTARY.shapes, build=_build)
