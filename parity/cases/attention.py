"""Parity of Megatron's ``DotProductAttention`` routed to the fused-attention op.

The patched path is taken by turning the fused kernel on through
:mod:`megatron_npu.ops.settings` (``use_flash_attn`` with the layout and pre/next window under
test), as ``megatron-npu train --use-flash-attn`` does. The reference is Megatron's own unfused
``DotProductAttention.forward`` (``ctx.original``: baddbmm, its torch softmax path, bmm) in the
upcast dtype; a pre/next window, which Megatron's unfused attention cannot express, is handed to
it as an explicit boolean mask built here from the window definition (query ``i`` sees key
``j`` iff ``-pre <= j - i - (sk - sq) <= next``, ``next`` capped at 0 under causal).
"""

from __future__ import annotations

from hypothesis import strategies as st

from parity.case import Context, ParityCase
from parity.cases._common import (
    fused_attention_settings,
    generator,
    grads,
    megatron_config,
    megatron_parallel,
)

FULL = 65536  # the seeds' "no window"


@st.composite
def _params(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    mask = draw(st.sampled_from(["causal", "causal", "padding", "none"]))
    kv_seq = None
    if mask == "causal" and draw(st.booleans()):
        seq = draw(st.integers(32, 64))
        pre, nxt = draw(st.sampled_from([4, 16])), 0
    else:
        seq = draw(st.integers(1, 48))
        pre, nxt = FULL, FULL
        if seq == 1 or draw(st.integers(0, 5)) == 0:  # a decode step: one query, a KV cache
            seq, kv_seq = 1, draw(st.integers(1, 24))
    return {
        "layout": draw(st.sampled_from(["SBH", "BSH"])),
        "mask": mask,
        "pre": pre,
        "next": nxt,
        "seq": seq,
        "kv_seq": kv_seq if kv_seq is not None else seq,
        "batch": draw(st.integers(1, 2)),
        "heads": heads,
        "groups": groups,
        "head_dim": draw(st.sampled_from([8, 16, 32])),
        "qk_scale": draw(st.sampled_from([1.0, 3.0])),
        "softmax_scale": draw(st.sampled_from([None, 0.05])),
        # --apply-query-key-layer-scaling: Megatron divides the softmax scale by the layer
        # number and multiplies the scores back by it inside its softmax
        "layer_scaling": draw(st.booleans()),
        "layer_number": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(p):
    import torch

    g = generator(p)
    sq, sk = p["seq"], p["kv_seq"]
    b, n, ng, d = p["batch"], p["heads"], p["groups"], p["head_dim"]

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    # key padding: batch row i keeps its first lengths[i] keys (never none of them)
    lengths = torch.randint(1, sk + 1, (b,), generator=g)
    padding = torch.arange(sk).view(1, 1, 1, sk) >= lengths.view(b, 1, 1, 1)
    return {
        "query": randn(sq, b, n, d, scale=p["qk_scale"]),
        "key": randn(sk, b, ng, d, scale=p["qk_scale"]),
        "value": randn(sk, b, ng, d),
        "grad_out": randn(sq, b, n * d),
        "padding_mask": padding.expand(b, 1, sq, sk).contiguous(),
    }


def _config(p, ctx: Context, reference: bool):
    import torch

    half = {} if reference else {
        "fp16": ctx.dtype == torch.float16, "bf16": ctx.dtype == torch.bfloat16,
    }  # fmt: skip
    return megatron_config(
        hidden_size=p["heads"] * p["head_dim"], num_attention_heads=p["heads"],
        num_query_groups=p["groups"], kv_channels=p["head_dim"], attention_dropout=0.0,
        masked_softmax_fusion=False, params_dtype=ctx.dtype,
        apply_query_key_layer_scaling=p["layer_scaling"], **half,
    )  # fmt: skip


def _mask_type(p):
    from megatron.core.transformer.enums import AttnMaskType

    return {
        "causal": AttnMaskType.causal,
        "padding": AttnMaskType.padding,
        "none": AttnMaskType.no_mask,
    }[p["mask"]]


def _window_mask(p):
    """True = masked: causal plus the pre/next window, queries aligned to the end of the keys."""
    import torch

    sq, sk = p["seq"], p["kv_seq"]
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    d = j - i - (sk - sq)
    hi = min(p["next"], 0) if p["mask"] == "causal" else p["next"]
    return (~((d >= -p["pre"]) & (d <= hi))).view(1, 1, sq, sk)


def _module(p, ctx: Context, reference: bool):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention(
        _config(p, ctx, reference), layer_number=p["layer_number"], attn_mask_type=_mask_type(p),
        attention_type="self", softmax_scale=p["softmax_scale"],
    )  # fmt: skip


def _qkv(ctx: Context, inputs):
    return (ctx.tensor(inputs[name], grad=True) for name in ("query", "key", "value"))


def _outputs(ctx: Context, inputs, out, q, k, v):
    result = {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), query=q, key=k, value=v)}
    if ctx.params["kv_seq"] == 1:
        # one key: every softmax row is the constant 1, so the grads of query and key are zero
        # by construction; the fused kernel's are rounding noise (~1e-7), which the cosine rule
        # cannot judge against an all-zero reference. Only out and grad_value say anything.
        del result["grad_query"], result["grad_key"]
    return result


def _run(ctx: Context, inputs):
    p = ctx.params
    mask = inputs["padding_mask"].to(ctx.device) if p["mask"] == "padding" else None
    with (
        megatron_parallel(),
        fused_attention_settings(
            use_flash_attn=True, shape_order=p["layout"], pre_tokens=p["pre"], next_tokens=p["next"]
        ),
    ):
        module = _module(p, ctx, reference=False)
        q, k, v = _qkv(ctx, inputs)
        return _outputs(ctx, inputs, module(q, k, v, mask), q, k, v)


def _reference(ctx: Context, inputs):
    p = ctx.params
    if p["mask"] == "padding":
        mask = inputs["padding_mask"]
    elif p["pre"] < FULL or p["next"] < FULL:
        mask = _window_mask(p)
    else:
        mask = None  # causal: Megatron builds its own causal mask; none: no mask
    with megatron_parallel():
        module = _module(p, ctx, reference=True)
        q, k, v = _qkv(ctx, inputs)
        return _outputs(ctx, inputs, ctx.original(module, q, k, v, mask), q, k, v)


def _edge(**kw):
    base = {
        "layout": "SBH", "mask": "causal", "pre": FULL, "next": FULL, "seq": 32, "kv_seq": 32,
        "batch": 2, "heads": 4, "groups": 2, "head_dim": 16, "qk_scale": 1.0,
        "softmax_scale": None, "layer_scaling": False, "layer_number": 1, "seed": 11,
    }  # fmt: skip
    base.update(kw)
    return base


DOT_PRODUCT_ATTENTION = ParityCase(
    name="attention",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="context output [s, b, np*hn]; grads of query, key and value (dropout 0)",
    reference_kind="Megatron's unfused DotProductAttention.forward on CPU, inputs upcast; "
    "windows as an explicit boolean mask",
    edge_cases=(
        _edge(),  # SBH, full causal, GQA 4/2
        _edge(layout="BSH", seq=48, kv_seq=48, pre=16, next=0, seed=12),  # BSH sliding window
        _edge(seq=64, kv_seq=64, pre=16, next=0, groups=1, seed=13),  # SBH window, MQA
        _edge(layout="BSH", seq=1, kv_seq=1, batch=1, seed=14),  # a one-token sequence
        _edge(seq=1, kv_seq=17, seed=16),  # a decode step: one query against a KV cache
        _edge(layout="BSH", mask="padding", seq=24, kv_seq=24, heads=2, groups=2, seed=15),
        _edge(layer_scaling=True, layer_number=3, seed=17),  # scores scaled back in softmax
    ),
)
