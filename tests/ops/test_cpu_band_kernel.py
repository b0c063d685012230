"""The C++ band-attention forward (``megatron_npu/ops/csrc/band_attention.cpp``) against plain
fp64 attention: output and log-sum-exp, for bands that reach each part of the kernel; its input
checks; and the fallback when it is switched off or cannot be built."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_npu.ops import attention as att
from megatron_npu.ops import cpu_band_kernel as kernel

# The kernel works on query chunks of 256 rows; keys every row of a chunk sees run in tiles of
# 512, the keys only some rows see (the band's edges) in sub-blocks of 64 rows.
CASES = {  # name: (bn, sq, skv, d, lo, hi), row i sees keys [i + lo, i + hi]
    "causal-window-several-full-tiles": (2, 1300, 1300, 64, -1100, 0),  # 844 shared keys
    "causal-window-narrower-than-a-chunk": (3, 1000, 1000, 32, -80, 0),  # no shared keys
    "window-narrower-than-a-sub-block": (1, 300, 300, 8, -3, 0),
    "look-ahead-band-longer-keys": (1, 513, 700, 16, -100, 30),
    "symmetric-band-covers-everything": (2, 300, 300, 64, -299, 299),
    "band-past-the-keys-empty-rows": (2, 700, 500, 64, 5, 40),  # rows >= 495 see nothing
    "band-before-the-keys-all-empty": (2, 700, 400, 64, -1000, -701),
    "full-causal-last-chunk-partial": (1, 1030, 1030, 64, -1029, 0),
    "head-dim-not-a-vector-multiple": (2, 600, 600, 20, -300, 0),
    "one-query": (3, 1, 900, 64, 400, 899),
}


def reference(q, k, v, lo, hi, scale):
    """fp64 attention where row i sees keys [i + lo, i + hi]; rows that see none give 0/-inf."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * scale
    i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None]
    visible = (j >= i + lo) & (j <= i + hi)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(visible, (scores - lse[..., None]).exp(), 0.0)
    return probs @ v, lse


@pytest.fixture
def built(monkeypatch):
    monkeypatch.delenv(kernel.ENV_VAR, raising=False)
    status = kernel.status()
    assert status.available, f"the C++ band kernel does not build here: {status.reason}"


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_kernel_matches_fp64_attention(case, built):
    bn, sq, skv, d, lo, hi = case
    gen = torch.Generator().manual_seed(sq + skv + d)
    q = torch.randn(bn, sq, d, generator=gen)
    k, v = (torch.randn(bn, skv, d, generator=gen) for _ in range(2))
    scale = 1 / math.sqrt(d)
    out, lse = kernel.band_attention_forward(q, k, v, lo, hi, scale)
    want_out, want_lse = reference(q, k, v, lo, hi, scale)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=2e-6)
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse.double()[~empty], want_lse[~empty], rtol=1e-5, atol=2e-6)
    assert not out[empty].any()  # rows that see no key output zeros


def test_kernel_reads_strided_inputs_and_any_thread_count(built):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(700, 2, 32, generator=gen).transpose(0, 1) for _ in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.band_attention_forward(q, k, v, -300, 0, 0.2)
    finally:
        torch.set_num_threads(threads)
    many = kernel.band_attention_forward(q.contiguous(), k, v, -300, 0, 0.2)
    again = kernel.band_attention_forward(q, k, v, -300, 0, 0.2)
    # the same thread count (and strided or contiguous input): bitwise the same
    assert torch.equal(many[0], again[0]) and torch.equal(many[1], again[1])
    # another thread count: the same chunks, but the BLAS sgemm inside a chunk may take another
    # kernel (MKL's sequential path differs from its path inside a parallel region on AVX-512
    # machines, by ~4e-7 here), so only float32 rounding apart
    torch.testing.assert_close(one[0], many[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one[1], many[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        one[0].double(), reference(q, k, v, -300, 0, 0.2)[0], rtol=1e-5, atol=2e-6
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q.double(), k, v), "float32"),
        (lambda q, k, v: (q[0], k, v), r"\(BN, S, D\)"),
        (lambda q, k, v: (q, k[:, :, :4], v), "query \\(BN, Sq, D\\)"),
        (lambda q, k, v: (q, k, v[:1]), "query \\(BN, Sq, D\\)"),
    ],
    ids=["not-fp32", "not-3d", "head-dim-differs", "value-shape-differs"],
)
def test_kernel_names_what_is_wrong(change, message, built):
    q, k, v = (torch.randn(2, 10, 8) for _ in range(3))
    with pytest.raises(RuntimeError, match=message):
        kernel.band_attention_forward(*change(q, k, v), -3, 0, 0.3)


def test_empty_band_is_refused(built):
    q = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="lo <= hi"):
        kernel.band_attention_forward(q, q, q, 1, 0, 1.0)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(kernel.ENV_VAR, "0")
    status = kernel.status()
    assert not status.available and kernel.ENV_VAR in status.reason
    assert "ATen flash pieces" in status.describe()
    q = torch.randn(1, 4, 8)
    assert kernel.band_attention_forward(q, q, q, -1, 0, 1.0) is None


def test_a_failed_build_falls_back_to_the_flash_pieces(monkeypatch):
    """No compiler (or ninja, or BLAS symbol): one status that says why, and windowed attention
    still runs, on the flash pieces, with the same result."""

    def no_compiler():
        raise OSError("ninja: c++: command not found\nsecond line")

    monkeypatch.delenv(kernel.ENV_VAR, raising=False)
    monkeypatch.setattr(kernel, "_status", None)
    monkeypatch.setattr(kernel, "_build", no_compiler)
    status = kernel.status()
    assert not status.available
    assert status.reason == "not built: OSError: ninja: c++: command not found"
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=gen) for _ in range(3))
    out = att.native_fused_attention(
        q, k, v, head_num=2, input_layout="BNSD", causal=True, pre_tokens=100, next_tokens=0
    )
    rows = (t.reshape(2, 300, 16) for t in (q, k, v))
    want, _ = reference(*rows, -100, 0, 0.25)
    torch.testing.assert_close(out.reshape(2, 300, 16).double(), want, rtol=1e-5, atol=2e-6)
