"""Parity of Megatron's ``DotProductAttention`` routed to the fused-attention op.

The patched path is taken by turning the fused kernel on through
:mod:`megatron_npu.ops.settings` (``use_flash_attn`` with the layout and pre/next window under
test), as ``megatron-npu train --use-flash-attn`` does. The reference is Megatron's own unfused
``DotProductAttention.forward`` (``ctx.original``: baddbmm, its torch softmax path, bmm) in the
upcast dtype; a pre/next window, which Megatron's unfused attention cannot express, is handed to
it as an explicit boolean mask built here from the window definition (query ``i`` sees key
``j`` iff ``-pre <= j - i - (sk - sq) <= next``, ``next`` capped at 0 under causal).

Examples reach every branch of the op: windows narrower than the sequence so the native path
runs its windowed query blocks (taken when the keys exceed window + 64; several blocks),
non-causal bands, padding masks combined with a window, GQA/MQA, decode steps, sequence
parallelism, attention dropout in training and in eval mode, and value heads narrower or wider
than the query/key heads (multi-latent attention: the module is built as the adaptor's
``TEDotProductAttention`` builds it, ``kv_channels`` the value width and the softmax scale over
the query/key width, and the fused path pads the narrower side).

Dropout: no reference can know the tested path's random keep mask, so the dropout examples
make it observable. ``value`` is one-hot over the key axis (``head_dim == kv_seq``,
``value[j] = e_j``), so the context row of query ``i`` *is* its dropped-out probability row
``P[i, j] * keep[i, j] / (1 - p)``. The run records ``keep = (out != 0)`` where the score was
visible; the reference replaces Megatron's ``attention_dropout`` by that fixed mask (same
stream on both paths) and runs Megatron's unfused forward/backward with it, so the kept
probabilities, the 1/(1-p) rescaling and every gradient are compared exactly as without
dropout. A ``keep_rate`` output (the kept share of visible scores, within 6 sigma of 1 - p
on the run side, the exact 1 - p in the reference) catches a wrong drop probability.
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import (
    fused_attention_settings,
    generator,
    grads,
    megatron_config,
    megatron_parallel,
)

FULL = 65536  # "no window" in the Ascend guide's scripts


@st.composite
def _params(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    mask = draw(st.sampled_from(["causal", "causal", "padding", "none"]))
    kv_seq = None
    window = draw(st.sampled_from(["none", "narrow", "blocks"]))
    if window == "blocks":  # the windowed query-block path: keys > window + 64, 2+ blocks
        seq = draw(st.integers(96, 200))
        pre = draw(st.sampled_from([4, 16, 31]))
        nxt = 0 if mask == "causal" else draw(st.sampled_from([0, 8]))
    elif mask == "causal" and window == "narrow":
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
        "head_dim": (head_dim := draw(st.sampled_from([8, 16, 32]))),
        # multi-latent attention: v heads narrower (DeepSeek-V3: 128 against 192) or wider
        "v_head_dim": draw(st.sampled_from([head_dim, head_dim, head_dim // 2, head_dim + 8])),
        "qk_scale": draw(st.sampled_from([1.0, 3.0])),
        "softmax_scale": draw(st.sampled_from([None, 0.05])),
        # --apply-query-key-layer-scaling: Megatron divides the softmax scale by the layer
        # number and multiplies the scores back by it inside its softmax
        "layer_scaling": draw(st.booleans()),
        "layer_number": draw(st.integers(1, 3)),
        "dropout": 0.0,
        "training": draw(st.booleans()),
        # the SP config asks for TP 2, which must divide the heads and the query groups
        "sp": draw(st.booleans()) if heads % 2 == 0 and groups % 2 == 0 else False,
        "seed": draw(st.integers(0, 2**16)),
    }


@st.composite
def _dropout_params(draw):
    """Dropout examples: one-hot values need head_dim == kv_seq (see the module docstring)."""
    seq = draw(st.sampled_from([16, 32]))
    heads = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([1, 2]))
    return _edge(
        mask=draw(st.sampled_from(["causal", "padding"])),
        seq=seq,
        kv_seq=seq,
        head_dim=seq,
        heads=heads,
        groups=groups,
        dropout=draw(st.sampled_from([0.1, 0.3])),
        training=True,
        sp=groups == 2 and draw(st.booleans()),
        batch=draw(st.integers(1, 2)),
        layout=draw(st.sampled_from(["SBH", "BSH"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _all_params():
    return st.one_of(_params(), _params(), _params(), _dropout_params())


def _inputs(p):
    import torch

    g = generator(p)
    sq, sk = p["seq"], p["kv_seq"]
    b, n, ng, d, dv = p["batch"], p["heads"], p["groups"], p["head_dim"], p["v_head_dim"]

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    # key padding: batch row i keeps its first lengths[i] keys (never none of them; with a
    # window, enough of them that every query still sees a key: a dead row would be zeros on
    # the fused path and uniform in Megatron's -10000 fill, neither of them meaningful)
    shortest = 1 if p["pre"] >= sk else max(1, sk - p["pre"])
    lengths = torch.randint(shortest, sk + 1, (b,), generator=g)
    padding = torch.arange(sk).view(1, 1, 1, sk) >= lengths.view(b, 1, 1, 1)
    if _dropout_active(p):  # value[j] = e_j: the context rows are the (dropped) probabilities
        value = torch.eye(sk, dtype=torch.float64).view(sk, 1, 1, sk).expand(sk, b, ng, dv)
    else:
        value = randn(sk, b, ng, dv)
    return {
        "query": randn(sq, b, n, d, scale=p["qk_scale"]),
        "key": randn(sk, b, ng, d, scale=p["qk_scale"]),
        "value": value.contiguous(),
        "grad_out": randn(sq, b, n * dv),
        "padding_mask": padding.expand(b, 1, sq, sk).contiguous(),
    }


def _config(p, ctx: Context, reference: bool):
    import torch

    half = (
        {}
        if reference
        else {
            "fp16": ctx.dtype == torch.float16,
            "bf16": ctx.dtype == torch.bfloat16,
        }
    )
    # sequence parallelism only changes whether dropout runs inside the RNG fork; the config
    # needs a tensor-parallel size for it, the module itself runs on one rank
    sp = {"sequence_parallel": True, "tensor_model_parallel_size": 2} if p["sp"] else {}
    return megatron_config(
        hidden_size=p["heads"] * p["head_dim"],
        num_attention_heads=p["heads"],
        num_query_groups=p["groups"],
        kv_channels=p["v_head_dim"],  # the output width, as TEDotProductAttention builds it
        attention_dropout=p["dropout"],
        masked_softmax_fusion=False,
        params_dtype=ctx.dtype,
        apply_query_key_layer_scaling=p["layer_scaling"],
        **half,
        **sp,
    )


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
    import math

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    scale = p["softmax_scale"]
    if scale is None and p["v_head_dim"] != p["head_dim"]:  # over the q/k width, as TE's
        scale = 1.0 / math.sqrt(p["head_dim"])
    module = DotProductAttention(
        _config(p, ctx, reference),
        layer_number=p["layer_number"],
        attn_mask_type=_mask_type(p),
        attention_type="self",
        softmax_scale=scale,
    )
    return module.train(p["training"])


def _fixed_dropout(keep, p: float):
    """Megatron's attention dropout with the keep mask the tested path drew (same stream)."""
    import torch

    class FixedDropout(torch.nn.Module):
        def forward(self, probs):
            return probs * keep.to(probs.dtype) / (1.0 - p)

    return FixedDropout()


#: the keep mask the last dropout run drew, read back from its output (module docstring)
_observed_keep: dict[str, object] = {}


def _dropout_active(p) -> bool:
    return p["dropout"] > 0 and p["training"]


def _observe_keep(p, out, mask):
    """``keep [b, n, sq, sk]`` and the kept share of visible scores, from the one-hot output."""
    import torch

    sq, b = p["seq"], p["batch"]
    probs = out.detach().float().view(sq, b, p["heads"], p["kv_seq"]).permute(1, 2, 0, 3)
    keep = probs != 0
    masked = _reference_mask(p, mask)
    visible = torch.ones_like(keep) if masked is None else ~masked.expand_as(keep)
    _observed_keep["keep"] = keep
    rate = keep[visible].double().mean()
    n = int(visible.sum())
    expected = 1.0 - p["dropout"]
    sigma = (p["dropout"] * expected / n) ** 0.5
    # within 6 sigma of the expected keep rate: report the expected value, else the observed
    kept = expected if abs(float(rate) - expected) <= 6 * sigma else float(rate)
    return torch.tensor([kept], dtype=out.dtype)


def _reference_mask(p, padding):
    """The boolean mask (True = masked) the reference hands Megatron, or None."""
    import torch

    windowed = p["pre"] < FULL or p["next"] < FULL
    if p["mask"] == "padding":
        return padding | _window_mask(p) if windowed else padding
    if windowed:
        return _window_mask(p)
    if p["mask"] == "causal":
        sq, sk = p["seq"], p["kv_seq"]
        return torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq).view(1, 1, sq, sk)
    return None


def _qkv(ctx: Context, inputs):
    return (ctx.tensor(inputs[name], grad=True) for name in ("query", "key", "value"))


def _outputs(ctx: Context, inputs, out, q, k, v, keep_rate=None):
    result = {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), query=q, key=k, value=v)}
    if keep_rate is not None:
        result["keep_rate"] = keep_rate
    if ctx.params["kv_seq"] == 1:
        # one key: every softmax row is the constant 1, so the grads of query and key are zero
        # by construction; the fused kernel's are rounding noise (~1e-7), which the cosine rule
        # cannot judge against an all-zero reference. Only out and grad_value say anything.
        del result["grad_query"], result["grad_key"]
    return result


def _run(ctx: Context, inputs):
    p = ctx.params
    _observed_keep.clear()  # a reference never sees the mask of an earlier example
    mask = inputs["padding_mask"].to(ctx.device) if p["mask"] == "padding" else None
    with (
        megatron_parallel(),
        fused_attention_settings(
            use_flash_attn=True, shape_order=p["layout"], pre_tokens=p["pre"], next_tokens=p["next"]
        ),
    ):
        module = _module(p, ctx, reference=False)
        q, k, v = _qkv(ctx, inputs)
        out = module(q, k, v, mask)
        rate = _observe_keep(p, out, inputs["padding_mask"]) if _dropout_active(p) else None
        return _outputs(ctx, inputs, out, q, k, v, rate)


def _reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    if p["mask"] == "padding" or p["pre"] < FULL or p["next"] < FULL:
        mask = _reference_mask(p, inputs["padding_mask"])
    else:
        mask = None  # causal: Megatron builds its own causal mask; none: no mask
    with megatron_parallel():
        module = _module(p, ctx, reference=True)
        rate = None
        if _dropout_active(p):
            # read, not taken: the stage-2 benchmark runs this reference a second time, in the
            # tested dtype, with the same observed mask
            module.attention_dropout = _fixed_dropout(_observed_keep["keep"], p["dropout"])
            rate = torch.tensor([1.0 - p["dropout"]], dtype=ctx.dtype)
        q, k, v = _qkv(ctx, inputs)
        return _outputs(ctx, inputs, ctx.original(module, q, k, v, mask), q, k, v, rate)


def _edge(**kw):
    base = {
        "layout": "SBH",
        "mask": "causal",
        "pre": FULL,
        "next": FULL,
        "seq": 32,
        "kv_seq": 32,
        "batch": 2,
        "heads": 4,
        "groups": 2,
        "head_dim": 16,
        "qk_scale": 1.0,
        "softmax_scale": None,
        "layer_scaling": False,
        "layer_number": 1,
        "dropout": 0.0,
        "training": True,
        "sp": False,
        "seed": 11,
    }
    base.update(kw)
    base.setdefault("v_head_dim", base["head_dim"])  # value heads as wide as q/k unless asked
    return base


DOT_PRODUCT_ATTENTION = ParityCase(
    name="attention",
    params=_all_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="context output [s, b, np*hn]; grads of query, key and value; with dropout the "
    "share of kept scores (module docstring)",
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
        # the windowed query blocks: 160 keys > window 17 + 64, three blocks of 64
        _edge(seq=160, kv_seq=160, pre=16, next=0, heads=2, groups=1, head_dim=8, seed=18),
        # a non-causal band with a padding mask, BSH, windowed blocks
        _edge(
            layout="BSH",
            mask="padding",
            seq=144,
            kv_seq=144,
            pre=24,
            next=8,
            heads=2,
            head_dim=8,
            seed=19,
        ),
        # CPU band paths (windows of 64+ keys, no mask, no dropout): a causal sliding window
        # runs batched (blocks of half the window, a padded last block); a band that also looks
        # ahead runs the per-block band pieces
        _edge(seq=200, kv_seq=200, pre=80, next=0, heads=2, groups=1, head_dim=8, seed=23),
        _edge(mask="none", seq=192, kv_seq=192, pre=72, next=8, heads=2, head_dim=8, seed=24),
        # dropout in training (SBH causal, GQA), with sequence parallelism (no RNG fork),
        # and in eval mode (dropout configured, not applied)
        _edge(seq=32, kv_seq=32, head_dim=32, dropout=0.2, seed=20),
        _edge(
            layout="BSH",
            mask="padding",
            seq=16,
            kv_seq=16,
            head_dim=16,
            dropout=0.3,
            sp=True,
            seed=21,
        ),
        _edge(dropout=0.2, training=False, seed=22),
        # multi-latent attention: v heads narrower than q/k (SBH, causal), and wider (BSH,
        # a sliding window, its query blocks)
        _edge(head_dim=24, v_head_dim=16, seed=25),
        _edge(layout="BSH", seq=96, kv_seq=96, pre=16, next=0, v_head_dim=24, seed=26),
    ),
)
