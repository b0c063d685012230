"""Rotary multiply ('half' and 'interleave'): native, NPU binding on the emulation, dispatcher."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron_npu.parity.verdict import require_accurate

from megatron_npu.ops import rotary
from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import (
    PATHS,
    native_kernels_around_each_test,  # noqa: F401
    run,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rot(path, x, r1, r2, mode):
    return run(
        path, rotary.rotary_mul, rotary.native_rotary_mul, rotary.npu_rotary_mul, x, r1, r2, mode
    )


def reference(x, cos, sin, mode):
    """Written out per output half / pair."""
    out = torch.empty_like(x)
    d = x.shape[-1]
    if mode == "half":
        h = d // 2
        x1, x2 = x[..., :h], x[..., h:]
        out[..., :h] = x1 * cos[..., :h] - x2 * sin[..., :h]
        out[..., h:] = x2 * cos[..., h:] + x1 * sin[..., h:]
    else:
        xe, xo = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = xe * cos[..., 0::2] - xo * sin[..., 0::2]
        out[..., 1::2] = xo * cos[..., 1::2] + xe * sin[..., 1::2]
    return out


@st.composite
def rotary_cases(draw):
    mode = draw(st.sampled_from(["half", "interleave"]))
    shape = [draw(st.integers(1, 4)) for _ in range(3)] + [2 * draw(st.integers(1, 16))]
    if mode == "interleave":  # 11SD / 1S1D / S11D
        keep = draw(st.integers(0, 2))
        r_shape = [s if i == keep else 1 for i, s in enumerate(shape[:3])] + [shape[3]]
    else:  # the documented layouts: 11SD, B1SD, 1S1D, BS1D, S11D, SB1D, full
        keep = draw(st.sampled_from([{2}, {0, 2}, {1}, {0, 1}, {0}, {0, 1, 2}]))
        r_shape = [s if i in keep else 1 for i, s in enumerate(shape[:3])] + [shape[3]]
    return dict(mode=mode, shape=shape, r_shape=r_shape, seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=30, deadline=None)
@given(case=rotary_cases())
def test_rotary_matches_fp64_reference(path, dtype_name, case):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["shape"], generator=gen).to(dtype)
    angle = torch.rand(case["r_shape"], generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    gy = torch.randn(case["shape"], generator=gen).to(dtype)
    xs, cs, ss = (t.clone().requires_grad_() for t in (x, cos, sin))
    y = rot(path, xs, cs, ss, case["mode"])
    y.backward(gy)

    xd, cd, sd = (t.double().requires_grad_() for t in (x, cos, sin))
    ref = reference(xd, cd.expand_as(xd), sd.expand_as(xd), case["mode"])
    ref.backward(gy.double())
    assert y.dtype == dtype
    require_accurate(y, ref, dtype, "y")
    require_accurate(xs.grad, xd.grad, dtype, "dx")
    require_accurate(cs.grad, cd.grad, dtype, "dcos")
    require_accurate(ss.grad, sd.grad, dtype, "dsin")


@pytest.mark.parametrize("path", PATHS)
def test_rotate_half_vs_interleave_differ(path):
    x = torch.arange(8.0).reshape(1, 1, 1, 8)
    zero, one = torch.zeros(1, 1, 1, 8), torch.ones(1, 1, 1, 8)
    half = rot(path, x, zero, one, "half")
    inter = rot(path, x, zero, one, "interleave")
    assert half.flatten().tolist() == [-4, -5, -6, -7, 0, 1, 2, 3]
    assert inter.flatten().tolist() == [-1, 0, -3, 2, -5, 4, -7, 6]


INVALID = [
    ("odd D", (1, 2, 3, 5), (1, 1, 3, 5), "half", r"D=5 must be even"),
    ("rank", (2, 3, 8), (1, 3, 8), "half", r"must be 4-D"),
    ("mode", (1, 2, 3, 8), (1, 1, 3, 8), "spiral", r"rotary_mode must be 'half' or 'interleave'"),
    ("broadcast", (1, 2, 3, 8), (1, 2, 4, 8), "half", r"must broadcast to"),
    ("interleave shape", (2, 2, 3, 8), (2, 1, 3, 8), "interleave", r"11SD, 1S1D or S11D"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("what,xs,rs,mode,message", INVALID, ids=[c[0] for c in INVALID])
def test_rotary_invalid_inputs(path, what, xs, rs, mode, message):
    with pytest.raises(ValueError, match=message):
        rot(path, torch.randn(xs), torch.randn(rs), torch.randn(rs), mode)


def test_rotary_emulation_checks_itself():
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"npu_rotary_mul: input, r1 and r2 must share one dtype"):
        emulation.npu_rotary_mul(
            x,
            torch.ones(1, 1, 3, 8, dtype=torch.float16),
            torch.ones(1, 1, 3, 8, dtype=torch.float16),
        )
    with pytest.raises(ValueError, match=r"npu_rotary_mul: r1/r2 last dim 6 must be the full D=8"):
        emulation.npu_rotary_mul(x, torch.ones(1, 1, 3, 6), torch.ones(1, 1, 3, 6))
