"""Megatron's core attention: stock unfused ``DotProductAttention`` vs the fused-attention op.

``megatron``: Megatron's own unfused path (baddbmm, its torch softmax with the causal mask,
bmm), as Megatron runs without TransformerEngine. Attention dropout off (kernel vs kernel).
``native``/``npu-binding``: the same module with the fused kernel turned on (``--use-flash-attn``),
causal, SBH layout. Hidden 1024 (16 heads x 64), sequence 2048, batch 1.

``TE_DOT_PRODUCT_ATTENTION`` times the Transformer Engine stand-in (``TEDotProductAttention``,
:mod:`megatron_npu.modules.te_layers`). Its patch replaces a ``MagicMock`` placeholder, which
:func:`perf.case.implementation` would hand the ``megatron`` path and which cannot run; there
that path is the local spec's core attention instead, what Megatron builds without TE: a stock
``DotProductAttention`` run through Megatron's own ``forward`` (the attention patch's recorded
original: the unfused path). ``native`` / ``npu-binding``: the stand-in installed at the TE
name, with ``--use-flash-attn`` (the fused op; ``npu_fusion_attention`` on the NPU). Same sizes.
"""

from __future__ import annotations

import torch

from megatron_npu.ops import settings
from perf.case import BenchCase, Built, Cell, implementation


def _setup(cell: Cell):
    """(config, q, k, v) of one cell: Megatron's config for the shape and dtype (its attention
    forks the RNG tracker, seeded here) and [s, b, n, d] inputs."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, b, n, d = (cell.shape[k] for k in ("seq", "batch", "heads", "head_dim"))
    model_parallel_cuda_manual_seed(0)
    dtype = cell.torch_dtype
    config = TransformerConfig(
        num_layers=1,
        hidden_size=n * d,
        num_attention_heads=n,
        use_cpu_initialization=True,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        masked_softmax_fusion=False,
        attention_dropout=0.0,
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, n, d, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    return config, q, k, v


def build(cell: Cell) -> Built:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config, q, k, v = _setup(cell)
    module = DotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    if cell.path != "megatron":
        settings.set_fused_attention(use_flash_attn=True)
    forward = implementation(cell)
    return Built(lambda: forward(module, q, k, v, None, AttnMaskType.causal), (q, k, v))


DOT_PRODUCT_ATTENTION = BenchCase(
    op="attention",
    shapes={
        "full": {"seq": 2048, "batch": 1, "heads": 16, "head_dim": 64},
        "quick": {"seq": 512, "batch": 1, "heads": 4, "head_dim": 64},
    },
    build=build,
    rounds=2,
)


def build_te(cell: Cell) -> Built:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_npu import patcher
    from megatron_npu.registry import get_patch
    from perf.case import installed_of

    config, q, k, v = _setup(cell)
    causal = AttnMaskType.causal
    if cell.path == "megatron":  # the local spec's core attention, Megatron's own forward
        module = DotProductAttention(
            config, layer_number=1, attn_mask_type=causal, attention_type="self"
        )
        forward = patcher.original(get_patch("attention.dot-product"))
        return Built(lambda: forward(module, q, k, v, None, causal), (q, k, v))
    settings.set_fused_attention(use_flash_attn=True)
    module = installed_of(cell)(
        config, layer_number=1, attn_mask_type=causal, attention_type="self"
    )
    return Built(lambda: module(q, k, v, None, attn_mask_type=causal), (q, k, v))


TE_DOT_PRODUCT_ATTENTION = BenchCase(
    op="te-attention",
    shapes=DOT_PRODUCT_ATTENTION.shapes,
    build=build_te,
    rounds=2,
    note="megatron: the local spec's DotProductAttention (unfused); the stand-in with "
    "--use-flash-attn otherwise",
)
