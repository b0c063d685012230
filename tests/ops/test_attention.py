"""Fused attention: native path, NPU binding on the emulation, and the dispatcher, against a plain
fp64 reference; layouts, windows, GQA, masks, dropout and input validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from megatron_npu.parity.metrics import dtype_config
from megatron_npu.parity.verdict import require_accurate

from megatron_npu.ops import attention as att
from megatron_npu.ops import cpu_band_kernel
from megatron_npu.ops.attention import band
from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import (
    PATHS,
    emulated_kernels,
    native_kernels_around_each_test,  # noqa: F401
    run,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BIG = att.MAX_TOKENS


@pytest.fixture(params=["cpp-kernel", "flash-pieces"])
def band_forward(request, monkeypatch):
    """Run a band test with each CPU forward: the C++ band kernel (which must build here) and
    the ATen flash pieces (the kernel switched off). Yields the list of forwards that ran (the
    test asserts it is not empty where a band path must run); none may be the other one."""
    if request.param == "flash-pieces":
        monkeypatch.setenv(cpu_band_kernel.ENV_VAR, "0")
    else:
        monkeypatch.delenv(cpu_band_kernel.ENV_VAR, raising=False)
        status = cpu_band_kernel.status()
        assert status.available, f"the C++ band kernel does not build here: {status.reason}"
    real, used = band.band_attention_forward, []

    def recording(*args):
        result = real(*args)
        used.append("cpp-kernel" if result is not None else "flash-pieces")
        return result

    monkeypatch.setattr(band, "band_attention_forward", recording)
    yield used
    assert set(used) <= {request.param}, f"band forward used: {used}"


def attend(path, q, k, v, **kw):
    return run(
        path,
        att.fused_attention,
        att.native_fused_attention,
        att.npu_fused_attention,
        q,
        k,
        v,
        **kw,
    )


# ----------------------------------------------------------------------------- reference


def reference_bnsd(q, k, v, *, causal, pre, nxt, masked=None, scale=None):
    """Plain fp64 attention on (B, N, S, D) tensors; ``masked`` True = hidden; bottom-right
    aligned window; rows with nothing visible give 0."""
    q, k, v = q.double(), k.double(), v.double()
    b, n, sq, d = q.shape
    skv = k.shape[2]
    group = n // k.shape[1]
    k = torch.cat([k[:, h // group : h // group + 1] for h in range(n)], dim=1)
    v = torch.cat([v[:, h // group : h // group + 1] for h in range(n)], dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    rel = torch.arange(skv)[None, :] - torch.arange(sq)[:, None] - (skv - sq)
    visible = (rel >= -pre) & (rel <= nxt)
    if causal:
        visible = visible & (rel <= 0)
    visible = visible.expand(b, n, sq, skv)
    if masked is not None:
        visible = visible & ~masked.bool().expand(b, n, sq, skv)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return torch.matmul(probs, v)


def to_layout(x_bnsd: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = x_bnsd.shape
    if layout == "BNSD":
        return x_bnsd.contiguous()
    if layout == "BSND":
        return x_bnsd.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x_bnsd.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    return x_bnsd.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()


def from_layout(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    s, b, h = x.shape
    return x.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


# ----------------------------------------------------------------------------- accuracy

window_values = st.sampled_from([BIG, 65536, 0, 1, 2, 3, 5, 8, 13, 40])


@st.composite
def attention_cases(draw):
    layout = draw(st.sampled_from(["SBH", "BSH", "BSND", "BNSD"]))
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3]))
    sq = draw(st.integers(1, 20))
    skv = draw(st.one_of(st.just(sq), st.integers(1, 20)))
    causal = draw(st.booleans())
    pre, nxt = draw(window_values), draw(window_values)
    mask_kind = draw(st.sampled_from([None, "SS", "11SS", "B1SS", "BNSS"]))
    return dict(
        layout=layout,
        batch=draw(st.integers(1, 2)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        sq=sq,
        skv=skv,
        dim=draw(st.sampled_from([1, 4, 8, 16])),
        causal=causal,
        pre=pre,
        nxt=nxt,
        mask_kind=mask_kind,
        scale=draw(st.sampled_from([None, 0.3])),
        seed=draw(st.integers(0, 2**16)),
    )


def make_mask(kind, b, n, sq, skv, gen):
    if kind is None:
        return None
    shape = {
        "SS": (sq, skv),
        "11SS": (1, 1, sq, skv),
        "B1SS": (b, 1, sq, skv),
        "BNSS": (b, n, sq, skv),
    }[kind]
    return torch.rand(shape, generator=gen) < 0.25


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=30, deadline=None)
@given(case=attention_cases())
# one key: dq is zero in exact arithmetic, and |dP| of about 10 leaves 1.44e-6 of float32 noise
@example(
    case={
        "layout": "SBH",
        "batch": 1,
        "heads": 4,
        "kv_heads": 2,
        "sq": 3,
        "skv": 1,
        "dim": 16,
        "causal": False,
        "pre": 2_147_483_647,
        "nxt": 2_147_483_647,
        "mask_kind": None,
        "scale": None,
        "seed": 7,
    }
)
def test_forward_and_backward_match_fp64_reference(path, dtype_name, case):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(case["seed"])
    b, n, nkv, sq, skv, d = (case[k] for k in ("batch", "heads", "kv_heads", "sq", "skv", "dim"))
    q = torch.randn(b, n, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, nkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, nkv, skv, d, generator=gen).to(dtype)
    grad_out = torch.randn(b, n, sq, d, generator=gen).to(dtype)
    mask = make_mask(case["mask_kind"], b, n, sq, skv, gen)
    layout = case["layout"]
    qs, ks, vs = (to_layout(t, layout).detach().requires_grad_() for t in (q, k, v))
    out = attend(
        path,
        qs,
        ks,
        vs,
        head_num=n,
        input_layout=layout,
        causal=case["causal"],
        attention_mask=mask,
        pre_tokens=case["pre"],
        next_tokens=case["nxt"],
        scale=case["scale"],
    )
    out.backward(to_layout(grad_out, layout))

    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_bnsd(
        rq,
        rk,
        rv,
        causal=case["causal"],
        pre=case["pre"],
        nxt=case["nxt"],
        masked=mask,
        scale=case["scale"],
    )
    ref.backward(grad_out.double())

    assert out.dtype == dtype and out.shape == qs.shape
    require_accurate(from_layout(out, layout, n), ref, dtype, "out")
    # a query's gradient sums over the keys; a key's (and value's) over the rows of every
    # query head that shares it
    dq_size, dk_size = zero_gradient_magnitudes(q, k, v, grad_out, case["scale"])
    require_gradient(
        from_layout(qs.grad, layout, n), rq.grad, dtype, "dq", terms=skv, magnitude=dq_size
    )
    kv_terms = sq * (n // nkv)
    require_gradient(
        from_layout(ks.grad, layout, nkv), rk.grad, dtype, "dk", terms=kv_terms, magnitude=dk_size
    )
    require_gradient(from_layout(vs.grad, layout, nkv), rv.grad, dtype, "dv", terms=kv_terms)


def require_gradient(got, want, dtype, what, terms: int = 1, magnitude: float = 0.0):
    """The verdict, except for a gradient that is exactly zero in exact arithmetic (every row
    sees at most one key, e.g. one key in all: the softmax is constant, so dq = dk = 0). Such
    a reference has no direction and msprobe's cosine calls any rounding noise an error. There
    the noise is bounded by rounding alone: each of the ``terms`` rounded products the gradient
    sums may leave up to the dtype's small-value threshold (megatron_npu.parity.metrics), and
    the softmax gradient ``dS = P (dP - sum P dP)`` cancels to a few ulps of ``dP``, so the sum
    carries up to ``4 eps`` of ``magnitude``, the largest sum of the absolute terms (hypothesis
    found 21 float32 terms of one key summing to 1.09e-6, above one threshold, 9.5e-7, and one
    key with |dP| of about 10 leaving 1.44e-6 in dq)."""
    if float(want.abs().max()) == 0.0:
        config = dtype_config(dtype)
        bound = max(config.small_value * max(terms, 1), 4 * torch.finfo(dtype).eps * magnitude)
        assert float(got.abs().max()) <= bound, f"{what}: {float(got.abs().max())} > {bound}"
        return
    require_accurate(got, want, dtype, what)


def zero_gradient_magnitudes(q, k, v, grad_out, scale):
    """(dq, dk) term magnitudes of :func:`require_gradient`, in BNSD with GQA heads expanded:
    ``scale * (|g| |v|^T) |k|`` and ``scale * (|g| |v|^T)^T |q|``."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.abs().double().repeat_interleave(group, dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dp = torch.matmul(grad_out.abs().double(), v.transpose(-1, -2))
    dq = float((torch.matmul(dp, k) * abs(scale)).max())
    dk = float((torch.matmul(dp.transpose(-1, -2), q.abs().double()) * abs(scale)).max())
    return dq, dk


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("path", PATHS)
def test_sbh_and_bsh_agree(path):
    gen = torch.Generator().manual_seed(1)
    s, b, h, n = 19, 3, 24, 6
    q_sbh, k_sbh, v_sbh = (torch.randn(s, b, h, generator=gen) for _ in range(3))
    kw = dict(head_num=n, causal=True, pre_tokens=7, next_tokens=0)
    out_sbh = attend(path, q_sbh, k_sbh, v_sbh, input_layout="SBH", **kw)
    out_bsh = attend(
        path,
        *(t.transpose(0, 1).contiguous() for t in (q_sbh, k_sbh, v_sbh)),
        input_layout="BSH",
        **kw,
    )
    torch.testing.assert_close(out_sbh.transpose(0, 1), out_bsh, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seq", [1, 40, 129])
def test_pre_next_65536_with_causal_is_full_causal(path, seq):
    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=gen) for _ in range(3))
    seeds = attend(
        path,
        q,
        k,
        v,
        head_num=3,
        input_layout="BNSD",
        causal=True,
        pre_tokens=65536,
        next_tokens=65536,
    )
    plain = attend(path, q, k, v, head_num=3, input_layout="BNSD", causal=True)
    ref = reference_bnsd(q, k, v, causal=True, pre=BIG, nxt=0)
    torch.testing.assert_close(seeds, plain, rtol=1e-6, atol=1e-6)
    require_accurate(seeds, ref, torch.float32, "pre=next=65536 causal")
    if seq > 1:  # it really is causal, not full attention
        full = reference_bnsd(q, k, v, causal=False, pre=BIG, nxt=BIG)
        assert (seeds.double() - full).abs().max() > 1e-2


def test_npu_plan_maps_windows_to_sparse_modes():
    plan = att.npu_sparse_plan(
        4096,
        4096,
        causal=True,
        pre_tokens=65536,
        next_tokens=65536,
        attention_mask=None,
        device="cpu",
    )
    assert plan.sparse_mode == 3 and plan.next_tockens == 0
    assert tuple(plan.atten_mask.shape) == (2048, 2048) and plan.atten_mask.dtype == torch.bool
    assert torch.equal(plan.atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    plan = att.npu_sparse_plan(
        4096, 4096, causal=True, pre_tokens=2048, next_tokens=0, attention_mask=None, device="cpu"
    )
    assert (plan.sparse_mode, plan.pre_tockens, plan.next_tockens) == (4, 2048, 0)
    assert tuple(plan.atten_mask.shape) == (2048, 2048)
    plan = att.npu_sparse_plan(
        64, 64, causal=False, pre_tokens=BIG, next_tokens=BIG, attention_mask=None, device="cpu"
    )
    assert plan.sparse_mode == 0 and plan.atten_mask is None
    user = torch.zeros(64, 64, dtype=torch.bool)
    user[:, 0] = True
    plan = att.npu_sparse_plan(
        64, 64, causal=True, pre_tokens=10, next_tokens=0, attention_mask=user, device="cpu"
    )
    assert (plan.sparse_mode, plan.pre_tockens, plan.next_tockens) == (0, 10, 0)
    i, j = torch.arange(64)[:, None], torch.arange(64)[None]
    expected = user | (j > i) | (j < i - 10)
    assert torch.equal(plan.atten_mask, expected)


class _Recorder:
    """Kernel module proxy that records the npu_fusion_attention keyword arguments."""

    def __init__(self):
        self.calls = []

    def npu_fusion_attention(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return emulation.npu_fusion_attention(*args, **kwargs)


def test_binding_passes_torch_npu_arguments():
    rec = _Recorder()
    q, k, v = (torch.randn(5, 2, 16) for _ in range(3))
    att.npu_fused_attention(
        rec, q, k, v, head_num=4, input_layout="SBH", causal=True, dropout_p=0.25
    )
    args, kwargs = rec.calls[0]
    assert args[3:] == (4, "SBH")
    assert kwargs["keep_prob"] == pytest.approx(0.75)
    assert kwargs["scale"] == pytest.approx(1 / math.sqrt(4))  # not the kernel's default 1.0
    assert kwargs["sparse_mode"] == 3 and kwargs["next_tockens"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_2048_is_a_causal_band(path, monkeypatch, band_forward):
    seq, window = 2600, 2048  # long enough for the window to bite and for blocked queries
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, seq, 4, generator=gen)
    k, v = (torch.randn(1, 1, seq, 4, generator=gen) for _ in range(2))
    blocks = []
    real = band.batched_band_block
    monkeypatch.setattr(
        band, "batched_band_block", lambda *a: blocks.append(real(*a)) or blocks[-1]
    )
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(
        path,
        qs,
        ks,
        vs,
        head_num=2,
        input_layout="BNSD",
        causal=True,
        pre_tokens=window,
        next_tokens=0,
    )
    out.sum().backward()
    # native takes the batched band path, with one padded block of 1024 after the first 2048
    assert blocks == ([1024] if path == "native" else [])
    assert len(band_forward) == (1 if path == "native" else 0)

    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    band_hidden = (j > i) | (j < i - window)  # sliding causal window of 2048 (+ itself)
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_bnsd(rq, rk, rv, causal=False, pre=BIG, nxt=BIG, masked=band_hidden)
    ref.sum().backward()
    require_accurate(out, ref, torch.float32, "window out")
    require_accurate(qs.grad, rq.grad, torch.float32, "window dq")
    require_accurate(ks.grad, rk.grad, torch.float32, "window dk")
    full_causal = reference_bnsd(q, k, v, causal=True, pre=BIG, nxt=0)
    assert (out[:, :, window + 1 :].double() - full_causal[:, :, window + 1 :]).abs().max() > 1e-3
    torch.testing.assert_close(
        out[:, :, : window + 1].double(), full_causal[:, :, : window + 1], rtol=1e-5, atol=1e-5
    )


BAND_WINDOWS = [  # (sq, skv, causal, pre, nxt): causal bands, offsets, symmetric windows
    (23, 23, True, 5, 0),
    (23, 23, True, 8, BIG),
    (17, 29, True, 6, 0),
    (29, 17, True, 9, 0),
    (29, 17, False, 3, 5),
    (17, 29, False, 9, 3),
    (23, 23, False, 4, 4),
    (23, 23, False, 3, 7),
    (20, 26, False, 6, 2),
    (26, 20, False, 2, 9),
    (19, 19, False, 13, 0),
    (19, 31, True, 40, 0),
]


@pytest.mark.parametrize("block", [2, 5])
@pytest.mark.parametrize("window", BAND_WINDOWS, ids=lambda w: "-".join(map(str, w)))
def test_band_pieces_match_fp64_reference_forward_and_backward(
    window, block, monkeypatch, band_forward
):
    """The band path (flash pieces merged by log-sum-exp, per-piece backward with the merged
    statistics) at tiny blocks, so every piece kind and every cut at the sequence ends occurs."""
    sq, skv, causal, pre, nxt = window
    monkeypatch.setattr(band, "BAND_MIN_BLOCK", 2)
    monkeypatch.setattr(band, "BAND_MAX_BLOCK", block)
    monkeypatch.setattr(band, "batched_band_block", lambda *a: 0)  # causal bands would take it
    gen = torch.Generator().manual_seed(sq * 100 + skv + block)
    q = torch.randn(2, 2, sq, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, skv, 8, generator=gen, requires_grad=True) for _ in range(2))
    lo, hi = att.window_bounds(sq, skv, causal, pre, nxt)
    plan = band.band_plan(q, sq, skv, lo, hi)
    assert plan is not None and len({p.q0 for p in plan}) > 1  # several query blocks
    assert {p.kind for p in plan} & {"reversed-causal", "causal"}
    out = att.native_fused_attention(
        q, k, v, head_num=2, input_layout="BNSD", causal=causal, pre_tokens=pre, next_tokens=nxt
    )
    assert band_forward  # the band path ran, with the forward this test is for
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_bnsd(rq, rk, rv, causal=causal, pre=pre, nxt=nxt)
    ref.backward(grad.double())
    require_accurate(out, ref, torch.float32, "band out")
    require_accurate(q.grad, rq.grad, torch.float32, "band dq")
    require_accurate(k.grad, rk.grad, torch.float32, "band dk")
    require_accurate(v.grad, rv.grad, torch.float32, "band dv")


BATCHED_BANDS = [  # (seq, window, block limit, "long" query count, block it gives)
    (24, 8, 4, 768, 4),  # blocks tile the sequence after the first window
    (23, 5, 2, 768, 2),  # padded last block, odd window
    (30, 8, 3, 768, 3),  # block does not divide the window: a partial middle column chunk
    (10, 8, 4, 768, 4),  # sequence just above the window (window + 2): one padded block
    (40, 9, 8, 768, 4),  # half the window: several middle column chunks
    (33, 7, 1, 768, 1),  # one-query blocks
    (29, 8, 16, 6, 8),  # only a whole window reaches the long-query count: no middle
]


@pytest.mark.parametrize("layout", ["BNSD", "SBH"])
@pytest.mark.parametrize("case", BATCHED_BANDS, ids=lambda c: "-".join(map(str, c)))
def test_batched_band_matches_fp64_reference_forward_and_backward(
    case, layout, monkeypatch, band_forward
):
    """The batched band path (causal sliding window: every block's pieces in one call per kind,
    overlapping middle keys' gradients added back) agrees with plain attention, GQA included."""
    seq, window, limit, long_queries, block = case
    monkeypatch.setattr(band, "BAND_MIN_BLOCK", 2)
    monkeypatch.setattr(band, "BATCHED_BAND_BLOCK", limit)
    monkeypatch.setattr(band, "FLASH_LONG_QUERIES", long_queries)
    monkeypatch.setattr(band, "band_plan", lambda *a: pytest.fail("per-block band path taken"))
    ran = []
    real = band.BatchedBandAttention.apply
    monkeypatch.setattr(band.BatchedBandAttention, "apply", lambda *a: ran.append(a[4]) or real(*a))
    gen = torch.Generator().manual_seed(seq * 100 + window + limit)
    q = torch.randn(2, 4, seq, 8, generator=gen)
    k, v = (torch.randn(2, 2, seq, 8, generator=gen) for _ in range(2))
    grad = torch.randn(q.shape, generator=gen)
    qs, ks, vs = (to_layout(t, layout).detach().requires_grad_() for t in (q, k, v))
    out = att.native_fused_attention(
        qs, ks, vs, head_num=4, input_layout=layout, causal=True, pre_tokens=window, next_tokens=0
    )
    out.backward(to_layout(grad, layout))
    assert ran == [block] and band_forward
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_bnsd(rq, rk, rv, causal=True, pre=window, nxt=0)
    ref.backward(grad.double())
    for name, got, want, heads in (
        ("out", out, ref, 4),
        ("dq", qs.grad, rq.grad, 4),
        ("dk", ks.grad, rk.grad, 2),
        ("dv", vs.grad, rv.grad, 2),
    ):
        torch.testing.assert_close(
            from_layout(got, layout, heads),
            want.float(),
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("block", [3, 4, 8])
def test_batched_band_any_block_up_to_the_window(block, band_forward):
    """Blocks need not divide the window, and a block as wide as the window has no middle."""
    seq, window = 21, 8
    gen = torch.Generator().manual_seed(block)
    q, k, v = (torch.randn(1, 2, seq, 4, generator=gen, requires_grad=True) for _ in range(3))
    out = band.BatchedBandAttention.apply(q, k, v, window, block, 0.5)
    assert band_forward
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_bnsd(rq, rk, rv, causal=True, pre=window, nxt=0, scale=0.5)
    ref.backward(grad.double())
    for got, want in ((out, ref), (q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad)):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_window_zero_sees_only_itself(path):
    q, k, v = (torch.randn(2, 3, 9, 4) for _ in range(3))
    out = attend(path, q, k, v, head_num=3, input_layout="BNSD", pre_tokens=0, next_tokens=0)
    torch.testing.assert_close(out, v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_window_longer_than_sequence_is_no_window(path):
    q, k, v = (torch.randn(1, 2, 11, 8) for _ in range(3))
    windowed = attend(
        path, q, k, v, head_num=2, input_layout="BNSD", causal=True, pre_tokens=500, next_tokens=0
    )
    causal = attend(path, q, k, v, head_num=2, input_layout="BNSD", causal=True)
    torch.testing.assert_close(windowed, causal, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_gqa_equals_repeated_kv_heads(path):
    q = torch.randn(2, 6, 10, 8)
    k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    gqa = attend(path, q, k, v, head_num=6, input_layout="BNSD", causal=True)
    mha = attend(
        path,
        q,
        k.repeat_interleave(3, 1),
        v.repeat_interleave(3, 1),
        head_num=6,
        input_layout="BNSD",
        causal=True,
    )
    torch.testing.assert_close(gqa, mha, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_dropout_keeps_expectation_and_drops(path):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 64, 8), torch.randn(2, 4, 64, 8)
    v = torch.ones(2, 4, 64, 8)
    out = attend(path, q, k, v, head_num=4, input_layout="BNSD", dropout_p=0.3)
    # each output is sum_j keep_j p_j / keep_prob: mean 1, but not all exactly 1
    assert abs(out.mean().item() - 1.0) < 0.05
    assert (out - 1.0).abs().max() > 0.05
    no_drop = attend(path, q, k, v, head_num=4, input_layout="BNSD", dropout_p=0.0)
    torch.testing.assert_close(no_drop, v)


# ----------------------------------------------------------------------------- invalid inputs

INVALID = [
    ("layout", dict(input_layout="XYZ"), r"input_layout 'XYZ' is not one of"),
    ("heads", dict(head_num=5), r"head_num 5 must divide"),
    (
        "mask shape",
        dict(attention_mask=torch.zeros(3, 7, dtype=torch.bool)),
        r"attention_mask shape \(3, 7\) is not one of",
    ),
    ("mask dtype", dict(attention_mask=torch.zeros(8, 8)), r"attention_mask dtype must be bool"),
    ("window", dict(pre_tokens=-3, next_tokens=1), r"window is empty"),
    ("dropout", dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("what,override,message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_inputs_name_the_constraint(path, what, override, message):
    q, k, v = (torch.randn(8, 2, 12) for _ in range(3))
    kw = dict(head_num=3, input_layout="SBH") | override
    with pytest.raises((ValueError, TypeError), match=message):
        attend(path, q, k, v, **kw)


@pytest.mark.parametrize("path", PATHS)
def test_invalid_gqa_and_dtype(path):
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 3, 6, 8)
    with pytest.raises(ValueError, match=r"multiple of key/value heads 3"):
        attend(path, q, k, k, head_num=4, input_layout="BNSD")
    qi = torch.ones(1, 4, 6, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"query dtype must be one of"):
        attend(path, qi, qi, qi, head_num=4, input_layout="BNSD")
    with pytest.raises(ValueError, match=r"key and value must have the same shape"):
        attend(path, q, q, q[:, :, :5], head_num=4, input_layout="BNSD")


# ----------------------------------------------------------------------------- the emulation itself


def _fa(q, k, v, **kw):
    return emulation.npu_fusion_attention(
        q, k, v, kw.pop("head_num", 2), kw.pop("input_layout", "BNSD"), **kw
    )


def test_emulation_returns_torch_npu_tuple():
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.bfloat16) for _ in range(3))
    out, smax, ssum, reserved, seed, offset, numels = _fa(q, k, v, scale=0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert smax.dtype == ssum.dtype == torch.float32
    assert smax.shape == ssum.shape == (2, 2, 5, 8)
    assert isinstance(reserved, torch.Tensor)
    assert (seed, offset, numels) == (0, 0, 0)
    *_, numels = _fa(q, k, v, keep_prob=0.9)
    assert numels == 2 * 2 * 5 * 5


def test_emulation_sparse_modes_follow_their_masks():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    tri = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    causal_ss = j > i
    mode0 = _fa(q, k, v, atten_mask=causal_ss, sparse_mode=0)[0]
    mode2 = _fa(q, k, v, atten_mask=tri, sparse_mode=2)[0]
    mode3 = _fa(q, k, v, atten_mask=tri, sparse_mode=3)[0]
    band = _fa(q, k, v, atten_mask=tri, sparse_mode=4, pre_tockens=2, next_tockens=0)[0]
    band0 = _fa(
        q, k, v, atten_mask=(j > i) | (j < i - 2), sparse_mode=0, pre_tockens=2, next_tockens=0
    )[0]
    torch.testing.assert_close(mode0, mode2)
    torch.testing.assert_close(mode0, mode3)
    torch.testing.assert_close(band, band0)
    # no atten_mask: the documented behaviour is full attention whatever sparse_mode says
    full = _fa(q, k, v, sparse_mode=3)[0]
    ref = reference_bnsd(q, k, v, causal=False, pre=BIG, nxt=BIG, scale=1.0)  # kernel default
    torch.testing.assert_close(full, ref.float())


EMULATION_INVALID = [
    (
        "layout",
        dict(input_layout="XYZ"),
        r"npu_fusion_attention: input_layout 'XYZ' is not one of BSH, SBH, BSND, BNSD, TND",
    ),
    (
        "compressed",
        dict(atten_mask=torch.ones(6, 6, dtype=torch.bool).triu(1), sparse_mode=3),
        r"sparse_mode 3 needs the compressed atten_mask of shape \(2048, 2048\)",
    ),
    (
        "compressed content",
        dict(atten_mask=torch.zeros(2048, 2048, dtype=torch.bool), sparse_mode=2),
        r"triu\(ones\(2048, 2048\), diagonal=1\)",
    ),
    (
        "mask shape",
        dict(atten_mask=torch.zeros(2, 6, 6, dtype=torch.bool)),
        r"atten_mask shape \(2, 6, 6\) must be BNSS, B1SS, 11SS or SS",
    ),
    ("mask dtype", dict(atten_mask=torch.zeros(6, 6)), r"atten_mask dtype must be bool or uint8"),
    ("keep_prob", dict(keep_prob=0.0), r"keep_prob must be in \(0, 1\]"),
    (
        "next",
        dict(atten_mask=torch.zeros(6, 6, dtype=torch.bool), pre_tockens=1, next_tockens=-2),
        r"negative next_tockens=-2 needs pre_tockens >=",
    ),
    (
        "band",
        dict(
            atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
            sparse_mode=4,
            pre_tockens=-3,
            next_tockens=1,
        ),
        r"pre_tockens \+ next_tockens >= 0",
    ),
    ("heads", dict(head_num=3), r"head_num 3 differs from query N 2"),
    ("sparse_mode", dict(sparse_mode=9), r"sparse_mode must be in 0..8"),
]


@pytest.mark.parametrize(
    "what,kw,message", EMULATION_INVALID, ids=[c[0] for c in EMULATION_INVALID]
)
def test_emulation_rejects_what_the_kernel_rejects(what, kw, message):
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    with pytest.raises((ValueError, TypeError), match=message):
        _fa(q, k, v, **kw)


def test_emulation_head_dim_and_layout_rank_limits():
    q = torch.randn(1, 2, 3, 800)
    with pytest.raises(ValueError, match=r"head dim D=800 is outside 1..768"):
        _fa(q, q, q)
    q3 = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"layout BNSD needs 4-D query"):
        _fa(q3, q3, q3)
    with pytest.raises(ValueError, match=r"head_num 3 does not divide H=8"):
        _fa(q3, q3, q3, head_num=3, input_layout="BSH")


def test_dispatch_uses_the_installed_kernels():
    rec = _Recorder()
    q = torch.randn(4, 1, 8)
    from megatron_npu.ops.kernels import use_npu_kernels

    use_npu_kernels(rec)
    try:
        att.fused_attention(q, q, q, head_num=2)
    finally:
        use_npu_kernels(None)
    assert len(rec.calls) == 1
    with emulated_kernels():
        att.fused_attention(q, q, q, head_num=2)
    assert len(rec.calls) == 1  # the recorder is no longer in use


# ----------------------------------------------------------------------------- supplied masks


def _document_mask(seq, starts):
    """Megatron's ``--reset-attention-mask`` mask (True = hidden): causal within documents."""
    doc = torch.zeros(seq, dtype=torch.long)
    for s in starts:
        doc[s:] += 1
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    return ((j > i) | (doc[:, None] != doc[None, :]))[None, None]


@pytest.mark.parametrize("path", PATHS)
def test_causal_attention_honours_a_document_mask(path):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=gen) for _ in range(3))
    mask = _document_mask(12, [5, 9])
    out = attend(path, q, k, v, head_num=2, input_layout="BNSD", causal=True, attention_mask=mask)
    ref = reference_bnsd(q, k, v, causal=True, pre=BIG, nxt=0, masked=mask)
    require_accurate(out, ref, torch.float32, "document mask")
    plain = reference_bnsd(q, k, v, causal=True, pre=BIG, nxt=0)
    assert (out.double() - plain).abs().max() > 1e-2  # the mask really changed the result


def test_plain_causal_mask_is_recognised_and_dropped():
    shape = att.AttentionShape(2, 2, 2, 12, 12, 8)
    causal = _document_mask(12, [])
    assert att.without_redundant_causal_mask(causal.expand(2, 1, 12, 12), shape, True) is None
    doc = _document_mask(12, [4])
    assert att.without_redundant_causal_mask(doc, shape, True) is doc
    assert att.without_redundant_causal_mask(causal, shape, False) is causal


def test_megatron_attention_with_a_document_mask_equals_megatron_unfused(gloo_world_of_one):
    """The patched DotProductAttention (fused kernel on) with a causal mask type and a document
    mask gives Megatron's own unfused result for that mask, instead of dropping the mask."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_npu
    from megatron_npu import patcher
    from megatron_npu.ops import settings
    from megatron_npu.registry import get_patch

    megatron_npu.apply("cpu")
    try:
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            use_cpu_initialization=True,
            masked_softmax_fusion=False,
            attention_dropout=0.0,
        )
        module = DotProductAttention(
            config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )
        gen = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(10, 1, 2, 8, generator=gen) for _ in range(3))
        mask = _document_mask(10, [4, 7])
        stock = patcher.original(get_patch("attention.dot-product"))
        expected = stock(module, q, k, v, mask, AttnMaskType.causal)
        settings.set_fused_attention(use_flash_attn=True)
        fused = module(q, k, v, mask, AttnMaskType.causal)
        torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    finally:
        settings.reset()
        megatron_npu.restore()
