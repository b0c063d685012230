"""Parity of context-parallel attention: TE's core attention with ``--context-parallel-size``.

The run builds the ``TEDotProductAttention`` the adaptor installed, with ``context_parallel_size``
set and the layer's ``cp_comm_type``, on real gloo groups of CP 2 and 4 (the pool initialises
Megatron's context-parallel group for the layout). Every rank takes Megatron-LM's load-balanced
rows of the full-sequence inputs (``get_batch_on_this_cp_rank``: chunks ``r`` and ``2 CP - 1 -
r`` of ``2 CP``), runs forward and backward, and the local output and q/k/v gradients are
all-gathered (a plain ``all_gather``, not the code under test) and stacked, so rank 0 compares
every rank's rows. The reference is independent softmax attention over the *whole* sequence on
the CPU, its gradients written out as flash attention's backward forms them, cut into the same
rows. Flash attention (and ``npu_fusion_attention_grad``, whose ``attention_in`` has the input
dtype) forms the backward's ``rowsum(dO * O)`` from the output as it returned it, rounded to the
dtype; so does the 16-bit benchmark here, where the upcast reference has no such rounding.

Drawn: the comm type (``p2p`` ring, ``a2a`` Ulysses, ``allgather``, and ``a2a+p2p``, the
hybrid over the pool's hierarchical groups: an all-to-all within 2 ranks, the ring over CP / 2),
causal or unmasked,
grouped-query heads (key/value heads that CP does not divide, shared out before a2a's
all-to-all), a causal sliding window for a2a and allgather (Megatron's ``window_size``, on
releases whose DotProductAttention takes one), the
softmax scale, flash attention requested or not (the fused op behind a2a and allgather), and
the sequence length (a multiple of 2 CP for both sizes).
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, Parallel, ParityCase
from megatron_npu.parity.cases._common import (
    fused_attention_settings,
    gather,
    generator,
    grads,
    megatron_config,
    megatron_parallel,
)

from megatron_npu.ops.context_parallel import local_rows

_EXT = "megatron.core.extensions.transformer_engine"
_SIZES = (2, 4)
#: every drawn sequence is a multiple of 2 x the largest CP size
_CHUNK = 2 * max(_SIZES)


def _windows_served() -> bool:
    """Megatron's DotProductAttention, on which the TE stand-in builds, takes a sliding window
    (``window_size`` reaches its softmax) from megatron-core 0.15; before, it refuses one."""
    import inspect

    try:
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    except ImportError:
        return False
    return "window_size" in inspect.signature(FusedScaleMaskSoftmax.__init__).parameters


_SHORT, _LONG = (3, 9) if _windows_served() else (None, None)
_WINDOWS = tuple(dict.fromkeys((None, _SHORT, _LONG)))


def _params():
    @st.composite
    def draw(d):
        comm = d(st.sampled_from(["p2p", "a2a", "allgather", "a2a+p2p"]))
        heads = d(st.sampled_from([4, 8]))  # a2a shares the heads out over up to 4 ranks
        causal = d(st.booleans())
        windowed = comm in ("a2a", "allgather") and causal  # the ring takes no window
        window = d(st.sampled_from(_WINDOWS)) if windowed else None
        return {
            "comm": comm,
            "causal": causal,
            "window": window,
            "heads": heads,
            "groups": d(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0])),
            "seq": _CHUNK * d(st.integers(1, 3)),
            "batch": d(st.integers(1, 2)),
            "head_dim": (head_dim := d(st.sampled_from([8, 16]))),
            # multi-latent attention's k_channels / v_channels: v heads narrower or wider
            "v_head_dim": d(st.sampled_from([head_dim, head_dim, head_dim // 2, head_dim + 8])),
            "softmax_scale": d(st.sampled_from([None, 0.3])),
            "flash": d(st.booleans()),
            "seed": d(st.integers(0, 2**16)),
        }

    return draw()


def _inputs(p):
    import torch

    g = generator(p)
    s, b, n, ng, d = p["seq"], p["batch"], p["heads"], p["groups"], p["head_dim"]
    dv = p["v_head_dim"]

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "query": randn(s, b, n, d),
        "key": randn(s, b, ng, d),
        "value": randn(s, b, ng, dv),
        "grad_out": randn(s, b, n * dv),
    }


def _run(ctx: Context, inputs):
    import importlib

    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    p = ctx.params
    cp = ctx.parallel.cp
    config = megatron_config(
        hidden_size=p["heads"] * p["head_dim"],
        num_attention_heads=p["heads"],
        num_query_groups=p["groups"],
        kv_channels=p["head_dim"],
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        params_dtype=ctx.dtype,
        context_parallel_size=cp,
        window_size=None if p["window"] is None else (p["window"], 0),
        fp16=ctx.dtype == torch.float16,
        bf16=ctx.dtype == torch.bfloat16,
    )
    mask_type = AttnMaskType.causal if p["causal"] else AttnMaskType.no_mask
    with megatron_parallel(), fused_attention_settings(use_flash_attn=p["flash"]):
        group = parallel_state.get_context_parallel_group()
        rank = group.rank()
        module = importlib.import_module(_EXT).TEDotProductAttention(
            config,
            layer_number=1,
            attn_mask_type=mask_type,
            attention_type="self",
            softmax_scale=p["softmax_scale"],
            cp_comm_type=p["comm"],
            # as MLASelfAttention builds it: q/k heads of k_channels, v heads of v_channels
            k_channels=p["head_dim"],
            v_channels=p["v_head_dim"],
        )
        q, k, v = (
            local_rows(ctx.tensor(inputs[n]), cp, rank).detach().requires_grad_()
            for n in ("query", "key", "value")
        )
        out = module(q, k, v, None, attn_mask_type=mask_type)
        upstream = local_rows(ctx.tensor(inputs["grad_out"]), cp, rank)
        result = {"out": out, **grads(out, upstream, query=q, key=k, value=v)}
        return {name: gather(t, group) for name, t in result.items()}


def _reference(ctx: Context, inputs):
    """Whole-sequence attention and its gradients written out as flash attention computes them:
    GEMM operands in the dtype, softmax and its gradient in fp32 at least, and the backward's
    ``rowsum(dO * O)`` from the output *as returned*, rounded to the dtype (flash attention's
    and ``npu_fusion_attention_grad``'s ``attention_in``); in the upcast dtype none of this
    rounds. Cut into each rank's rows."""
    import torch

    p = ctx.params
    cp = ctx.parallel.cp
    s, n, ng, d, v_dim = p["seq"], p["heads"], p["groups"], p["head_dim"], p["v_head_dim"]
    dtype = ctx.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v = (ctx.tensor(inputs[n_]).to(work) for n_ in ("query", "key", "value"))
    grad_out = ctx.tensor(inputs["grad_out"]).to(work).reshape(s, -1, n, v_dim)
    group = n // ng  # head h reads key/value group h // group
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scale = p["softmax_scale"] if p["softmax_scale"] is not None else d**-0.5
    hidden = torch.zeros(s, s, dtype=torch.bool)
    if p["causal"]:
        hidden |= torch.ones(s, s, dtype=torch.bool).triu(1)
    if p["window"] is not None:  # Megatron's window (w, 0): each query sees itself and w before
        hidden |= torch.ones(s, s, dtype=torch.bool).tril(-p["window"] - 1)

    def gemm(spec, a, b):  # operands in the dtype, as the kernel feeds its matrix unit
        return torch.einsum(spec, a.to(dtype), b.to(dtype)).to(work)

    scores = (gemm("sbnd,tbnd->bnst", q, kk) * scale).masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, -1)
    out = gemm("bnst,tbnd->sbnd", probs, vv).to(dtype)  # the output as returned
    dprobs = gemm("sbnd,tbnd->bnst", grad_out, vv)
    delta = torch.einsum("sbnd,sbnd->bns", grad_out, out.to(work)).unsqueeze(-1)
    dscores = probs * (dprobs - delta) * scale
    dq = gemm("bnst,tbnd->sbnd", dscores, kk)
    dk = gemm("bnst,sbnd->tbnd", dscores, q)
    dv = gemm("bnst,sbnd->tbnd", probs, grad_out)
    dk, dv = (t.unflatten(2, (ng, group)).sum(3) for t in (dk, dv))
    result = {
        "out": out.reshape(s, -1, n * v_dim),
        "grad_query": dq.to(dtype),
        "grad_key": dk.to(dtype),
        "grad_value": dv.to(dtype),
    }
    return {
        name: torch.stack([_megatron_rows(t, cp, r) for r in range(cp)])
        for name, t in result.items()
    }


def _megatron_rows(x, cp: int, rank: int):
    """The reference's own statement of Megatron-LM's ``get_batch_on_this_cp_rank`` cut (the
    reference calls no adaptor code): ``2 CP`` chunks, rank ``r`` keeps ``r`` and
    ``2 CP - 1 - r``."""
    import torch

    chunks = x.view(2 * cp, x.shape[0] // (2 * cp), *x.shape[1:])
    return chunks.index_select(0, torch.tensor([rank, 2 * cp - 1 - rank])).flatten(0, 1)


def _edge(**kw):
    base = {
        "comm": "p2p",
        "causal": True,
        "window": None,
        "heads": 4,
        "groups": 2,
        "seq": _CHUNK * 2,
        "batch": 2,
        "head_dim": 8,
        "softmax_scale": None,
        "flash": False,
        "seed": 1,
    }
    base.update(kw)
    base.setdefault("v_head_dim", base["head_dim"])  # value heads as wide as q/k unless asked
    return base


TE_CONTEXT_PARALLEL_ATTENTION = ParityCase(
    name="te-context-parallel-attention",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="every CP rank's context output [s / CP, b, np*hn] and query/key/value grads "
    "(its load-balanced rows), all-gathered and stacked, per comm type (p2p ring, a2a, "
    "allgather, a2a+p2p), causal or unmasked, with GQA, sliding windows and "
    "flash attention requested",
    reference_kind="independent softmax(Q K^T * scale, masked) V over the whole sequence on CPU "
    "and its gradients written out as flash attention's backward forms them (rowsum(dO O) from "
    "the output in the tested dtype for the 16-bit benchmark), cut into each rank's rows",
    parallel=tuple(Parallel(cp=cp) for cp in _SIZES),
    edge_cases=(
        _edge(),  # the ring, causal, GQA 4/2
        _edge(causal=False, seed=2),  # the ring, unmasked
        _edge(comm="a2a", seed=3),
        _edge(comm="a2a", groups=1, flash=True, seed=4),  # MQA: k/v shared out before a2a
        _edge(comm="a2a", window=_SHORT, flash=True, seed=5),  # a causal window
        _edge(comm="allgather", seed=6),
        _edge(comm="allgather", causal=False, flash=True, softmax_scale=0.3, seed=7),
        _edge(comm="allgather", window=_LONG, heads=8, groups=8, seed=8),
        # the hybrid: an all-to-all within pairs of ranks, the ring over the pairs
        _edge(comm="a2a+p2p", seed=9),
        _edge(comm="a2a+p2p", causal=False, groups=1, flash=True, seed=10),
        # multi-latent attention: v heads narrower than q/k on the ring, wider under a2a
        _edge(head_dim=16, v_head_dim=8, seed=11),
        _edge(comm="a2a", v_head_dim=16, flash=True, seed=12),
    ),
)
