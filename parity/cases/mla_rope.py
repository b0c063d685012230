"""Parity of multi-latent attention's fused YaRN RoPE (``apply_rope_fusion``, Megatron-LM's
default) that the adaptor provides in place of Megatron's Triton kernels
``fused_apply_mla_rope_for_q`` / ``fused_apply_mla_rope_for_kv``.

Inputs are laid out as ``MLASelfAttention`` hands them over: the query ``[s, b, n, qk + emb]``
(its last ``emb`` features rotated), the up-projected ``kv`` ``[s, b, n, k + v]`` and the shared
``k_pos_emb`` ``[s, b, 1, emb]``, and the cos/sin cache ``[rows, 1, 1, emb]`` of
``YarnRotaryEmbedding.get_cached_cos_sin`` (YaRN's concentration factor folded in, 1 or above,
so values may leave [-1, 1]; in the model's dtype; rows may exceed ``s``). Drawn: every width,
one or several heads, short and longer caches, both scales.

The reference states the Triton kernels' own arithmetic in plain torch in the upcast dtype: with
``x1 = x[..., 0::2]``, ``x2 = x[..., 1::2]`` and the cache's halves ``c1 | c2``, ``s1 | s2``,
the rotated features are ``x1*c1 - x2*s1`` followed by ``x2*c2 + x1*s2``; the query's first
``qk`` features pass through, the key is ``k_nope`` followed by the rotated ``k_pos_emb`` on
every head, and the value is kv's last ``v`` features.
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import generator, grads

#: ``_yarn_get_concentration_factor`` of Megatron's MLA defaults (scaling factor 40, mscale 1,
#: mscale_all_dim 0): 0.1 * ln(40) + 1
YARN_DEFAULT_SCALE = 1.3689


@st.composite
def _params(draw):
    return {
        "seq": draw(st.integers(1, 32)),
        "batch": draw(st.integers(1, 2)),
        "heads": draw(st.integers(1, 4)),
        "qk_dim": draw(st.sampled_from([8, 16, 32])),
        "emb_dim": draw(st.sampled_from([4, 8, 16, 64])),
        "v_dim": draw(st.sampled_from([8, 16, 24])),
        "mscale": draw(st.sampled_from([1.0, YARN_DEFAULT_SCALE])),
        "extra_rows": draw(st.sampled_from([0, 0, 7])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _cache(p, g):
    """YaRN's cos/sin cache: angles position * base**(-2i/emb), halves duplicated, scaled."""
    import torch

    emb, rows = p["emb_dim"], p["seq"] + p["extra_rows"]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, emb, 2, dtype=torch.float64) / emb))
    inv_freq = inv_freq * torch.empty(emb // 2, dtype=torch.float64).uniform_(0.5, 1.0, generator=g)
    angles = torch.arange(rows, dtype=torch.float64).view(rows, 1) * inv_freq
    freqs = torch.cat((angles, angles), dim=-1).view(rows, 1, 1, emb)
    return torch.cos(freqs) * p["mscale"], torch.sin(freqs) * p["mscale"]


def _inputs(p):
    import torch

    g = generator(p)
    s, b, n = p["seq"], p["batch"], p["heads"]
    qk, emb, v = p["qk_dim"], p["emb_dim"], p["v_dim"]
    cos, sin = _cache(p, g)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": randn(s, b, n, qk + emb),
        "kv": randn(s, b, n, qk + v),
        "k_pos_emb": randn(s, b, 1, emb),
        "cos": cos,
        "sin": sin,
        "grad_q": randn(s, b, n, qk + emb),
        "grad_key": randn(s, b, n, qk + emb),
        "grad_value": randn(s, b, n, v),
    }


def _kernel_rotation(x, cos, sin):
    """The Triton kernels' rotation of ``x`` ``[..., emb]`` (module docstring)."""
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def _cos_sin(ctx: Context, inputs):
    return ctx.tensor(inputs["cos"]), ctx.tensor(inputs["sin"])


def _run_q(ctx: Context, inputs):
    from megatron.core.transformer import multi_latent_attention as mla

    p = ctx.params
    q = ctx.tensor(inputs["q"], grad=True)
    cos, sin = _cos_sin(ctx, inputs)
    out = mla.fused_apply_mla_rope_for_q(q, cos, sin, p["qk_dim"], p["emb_dim"])
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_q"]), q=q)}


def _reference_q(ctx: Context, inputs):
    import torch

    p = ctx.params
    q = ctx.tensor(inputs["q"], grad=True)
    cos, sin = (t[: p["seq"]] for t in _cos_sin(ctx, inputs))
    nope, pe = q[..., : p["qk_dim"]], q[..., p["qk_dim"] :]
    out = torch.cat((nope, _kernel_rotation(pe, cos, sin)), dim=-1)
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_q"]), q=q)}


def _key_value_grads(ctx: Context, inputs, key, value, kv, k_pos_emb) -> dict:
    import torch

    torch.autograd.backward(
        (key, value),
        (
            ctx.tensor(inputs["grad_key"]).to(key.dtype),
            ctx.tensor(inputs["grad_value"]).to(value.dtype),
        ),
    )
    return {"key": key, "value": value, "grad_kv": kv.grad, "grad_k_pos_emb": k_pos_emb.grad}


def _kv_inputs(ctx: Context, inputs):
    p = ctx.params
    s, b, n = p["seq"], p["batch"], p["heads"]
    kv = ctx.tensor(inputs["kv"], grad=True)
    k_pos_emb = ctx.tensor(inputs["k_pos_emb"], grad=True)
    return kv, k_pos_emb, (s, b, n)


def _run_kv(ctx: Context, inputs):
    from megatron.core.transformer import multi_latent_attention as mla

    p = ctx.params
    kv, k_pos_emb, _ = _kv_inputs(ctx, inputs)
    cos, sin = _cos_sin(ctx, inputs)
    key, value = mla.fused_apply_mla_rope_for_kv(
        kv, k_pos_emb, cos, sin, p["emb_dim"], p["qk_dim"], p["v_dim"]
    )
    return _key_value_grads(ctx, inputs, key, value, kv, k_pos_emb)


def _reference_kv(ctx: Context, inputs):
    import torch

    p = ctx.params
    kv, k_pos_emb, (s, b, n) = _kv_inputs(ctx, inputs)
    cos, sin = (t[:s] for t in _cos_sin(ctx, inputs))
    pe = _kernel_rotation(k_pos_emb, cos, sin).expand(s, b, n, p["emb_dim"])
    key = torch.cat((kv[..., : p["qk_dim"]], pe), dim=-1)
    value = kv[..., p["qk_dim"] :]
    return _key_value_grads(ctx, inputs, key, value, kv, k_pos_emb)


def _edge(**kw):
    base = {
        "seq": 16,
        "batch": 2,
        "heads": 4,
        "qk_dim": 16,
        "emb_dim": 8,
        "v_dim": 16,
        "mscale": 1.0,
        "extra_rows": 0,
        "seed": 1,
    }
    base.update(kw)
    return base


_EDGES = (
    _edge(),
    _edge(mscale=YARN_DEFAULT_SCALE, extra_rows=7, seed=2),  # YaRN's scale; a longer cache
    _edge(seq=1, batch=1, heads=1, emb_dim=4, v_dim=8, seed=3),  # one token, one head
    _edge(qk_dim=32, emb_dim=64, v_dim=24, heads=2, seed=4),  # DeepSeek's proportions, small
)
_REFERENCE_KIND = (
    "the Triton kernels' arithmetic (even/odd features against the cache's halves) in plain "
    "torch on CPU, inputs upcast"
)

MLA_ROPE_Q = ParityCase(
    name="mla-rope-q",
    params=_params(),
    make_inputs=_inputs,
    run=_run_q,
    reference=_reference_q,
    compares="query [s, b, n, qk + emb] with its last emb features rotated, and grad of query",
    reference_kind=_REFERENCE_KIND,
    edge_cases=_EDGES,
)

MLA_ROPE_KV = ParityCase(
    name="mla-rope-kv",
    params=_params(),
    make_inputs=_inputs,
    run=_run_kv,
    reference=_reference_kv,
    compares="key [s, b, n, k + emb] (rotated k_pos_emb on every head), value [s, b, n, v], "
    "and grads of kv and k_pos_emb",
    reference_kind=_REFERENCE_KIND,
    edge_cases=_EDGES,
)
