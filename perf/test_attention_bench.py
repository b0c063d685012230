"""Attention targets on CPU, native path, fp32 (non-patch benchmarks: ``patch_id`` is null).

* ``attention-window``: causal sliding window of 2048 vs full causal attention at S=8192
  (target: the window at least 2x faster, forward). The window's forward is the C++ band
  kernel where it builds (``extra_info["band_forward"]`` names the one that ran; set
  ``MEGATRON_NPU_CPU_KERNEL=0`` to time the ATen flash pieces instead);
* ``attention-vs-sdpa``: the fused op (SBH, causal) vs plain
  ``scaled_dot_product_attention(is_causal=True)`` on the same tensors, forward+backward
  (target: within 1.1x).

Run with ``pytest perf --benchmark-only``; compare the medians within each group. Three warm-up
rounds: the first calls in a fresh process fault in the allocator's pages (a full-suite run at
one warm-up round timed the window's five rounds at 0.27 s falling to 0.16 s); steady state is
what a training run sees.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_npu.ops import cpu_band_kernel
from megatron_npu.ops.attention import MAX_TOKENS, fused_attention, native_fused_attention

B, N, S, D = 1, 4, 8192, 64
WINDOW = 2048
DTYPE = torch.float32

CASES = {
    "window-2048": dict(pre_tokens=WINDOW, next_tokens=0),
    "full-causal": dict(pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS),
}


def _label(benchmark, op, shape, direction, path="native", **extra):
    benchmark.group = op
    benchmark.extra_info.update(
        patch_id=None,
        op=op,
        path=path,
        device="cpu",
        emulated=False,
        dtype="float32",
        shape=shape,
        direction=direction,
        peak_memory_bytes=None,
        torch_threads=torch.get_num_threads(),
        **extra,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_attention_window_vs_full_causal(benchmark, case):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, S, D, generator=gen, dtype=DTYPE) for _ in range(3))
    kwargs = dict(head_num=N, input_layout="BNSD", causal=True, **CASES[case])

    def forward():
        with torch.no_grad():
            return native_fused_attention(q, k, v, **kwargs)

    band = cpu_band_kernel.status().describe() if case != "full-causal" else None
    _label(
        benchmark,
        "attention-window",
        f"B={B},N={N},S={S},D={D}",
        "fwd",
        case=case,
        pre_tokens=kwargs["pre_tokens"],
        next_tokens=kwargs["next_tokens"],
        band_forward=band,
    )
    out = benchmark.pedantic(forward, rounds=7, iterations=1, warmup_rounds=3)
    assert out.shape == (B, N, S, D) and torch.isfinite(out).all()
    # the last query sees only the last WINDOW + 1 keys under the window, all keys otherwise
    probe = native_fused_attention(
        q[:, :, -1:],
        k,
        v,
        head_num=N,
        input_layout="BNSD",
        causal=True,
        pre_tokens=kwargs["pre_tokens"],
        next_tokens=0,
    )
    torch.testing.assert_close(out[:, :, -1:], probe, rtol=1e-4, atol=1e-5)


SDPA_S, SDPA_B, SDPA_N, SDPA_D = 2048, 1, 16, 64  # hidden 1024


@pytest.mark.parametrize("which", ["fused-op", "plain-sdpa"])
def test_fused_attention_vs_plain_sdpa(benchmark, which):
    gen = torch.Generator().manual_seed(0)
    sbh = [
        torch.randn(SDPA_S, SDPA_B, SDPA_N * SDPA_D, generator=gen).requires_grad_()
        for _ in range(3)
    ]
    grad = torch.randn(SDPA_S, SDPA_B, SDPA_N * SDPA_D, generator=gen)

    def to_bnsd(t):
        return t.view(SDPA_S, SDPA_B, SDPA_N, SDPA_D).permute(1, 2, 0, 3)

    def fused():
        return fused_attention(*sbh, head_num=SDPA_N, input_layout="SBH", causal=True)

    def plain():  # the same SBH tensors in and out, as a plain model would write it
        out = F.scaled_dot_product_attention(*map(to_bnsd, sbh), is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(SDPA_S, SDPA_B, SDPA_N * SDPA_D)

    fn = fused if which == "fused-op" else plain

    def step():
        for t in sbh:
            t.grad = None
        fn().backward(grad)

    _label(
        benchmark,
        "attention-vs-sdpa",
        f"S={SDPA_S},B={SDPA_B},N={SDPA_N},D={SDPA_D}",
        "fwd+bwd",
        path="native" if which == "fused-op" else "plain-torch",
        case=which,
    )
    benchmark.pedantic(step, rounds=7, iterations=1, warmup_rounds=3)
