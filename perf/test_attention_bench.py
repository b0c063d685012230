"""Windowed (sliding-window causal, 2048) vs full causal fused attention on CPU, native path.

Run with ``pytest perf --benchmark-only`` (this directory is not in the default test paths).
Median seconds per forward call are the figures to compare; ``extra_info`` records the setup.
"""

from __future__ import annotations

import platform

import pytest
import torch

from megatron_npu.ops.attention import MAX_TOKENS, native_fused_attention

B, N, S, D = 1, 4, 8192, 64
WINDOW = 2048
DTYPE = torch.float32

CASES = {
    "window-2048": dict(pre_tokens=WINDOW, next_tokens=0),
    "full-causal": dict(pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_window_vs_full_causal(benchmark, case):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, S, D, generator=gen, dtype=DTYPE) for _ in range(3))
    kwargs = dict(head_num=N, input_layout="BNSD", causal=True, **CASES[case])

    def forward():
        with torch.no_grad():
            return native_fused_attention(q, k, v, **kwargs)

    benchmark.group = "attention-window"
    benchmark.extra_info.update(
        device="cpu",
        cpu=platform.processor() or platform.machine(),
        torch_threads=torch.get_num_threads(),
        dtype=str(DTYPE).replace("torch.", ""),
        layout="BNSD",
        shape={"B": B, "N": N, "S": S, "D": D},
        causal=True,
        pre_tokens=kwargs["pre_tokens"],
        next_tokens=kwargs["next_tokens"],
        window=WINDOW if case == "window-2048" else None,
        path="native",
    )
    out = benchmark.pedantic(forward, rounds=5, iterations=1, warmup_rounds=1)
    assert out.shape == (B, N, S, D) and torch.isfinite(out).all()
    # the last query sees only the last WINDOW + 1 keys under the window, all keys otherwise
    probe = native_fused_attention(q[:, :, -1:], k, v, head_num=N, input_layout="BNSD",
                                   causal=True, pre_tokens=kwargs["pre_tokens"], next_tokens=0)
    torch.testing.assert_close(out[:, :, -1:], probe, rtol=1e-4, atol=1e-5)
