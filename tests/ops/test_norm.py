"""RMSNorm (native, NPU binding on the emulation, dispatcher) and LayerNorm against plain fp64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_npu.ops import norm
from megatron_npu.testing import torch_npu_emulation as emulation

from ._accuracy import assert_accurate
from ._paths import (
    PATHS,
    native_kernels_around_each_test,  # noqa: F401
    run,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rms(path, x, w, eps):
    return run(path, norm.rms_norm, norm.native_rms_norm, norm.npu_rms_norm, x, w, eps)


@st.composite
def rms_cases(draw):
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    norm_dims = draw(st.lists(st.integers(1, 48), min_size=1, max_size=2))
    return dict(shape=tuple(lead + norm_dims), k=len(norm_dims),
                fp32_weight=draw(st.booleans()), eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=30, deadline=None)
@given(case=rms_cases())
def test_rms_norm_matches_fp64_reference(path, dtype_name, case):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(case["seed"])
    shape, k = case["shape"], case["k"]
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w_dtype = torch.float32 if case["fp32_weight"] else dtype
    w = (1 + 0.5 * torch.randn(shape[-k:], generator=gen)).to(w_dtype)
    gy = torch.randn(shape, generator=gen).to(dtype)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, rstd = rms(path, xs, ws, case["eps"])
    y.backward(gy)

    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    dims = tuple(range(len(shape) - k, len(shape)))
    ms = (xd * xd).mean(dim=dims, keepdim=True)
    ref_rstd = 1.0 / torch.sqrt(ms + case["eps"])
    ref = xd * ref_rstd * wd
    ref.backward(gy.double())

    assert y.dtype == dtype and rstd.dtype == torch.float32
    assert rstd.shape == shape[: len(shape) - k] + (1,) * k
    assert_accurate(y, ref, dtype, "y")
    assert_accurate(rstd, ref_rstd, torch.float32, "rstd")
    assert_accurate(xs.grad, xd.grad, dtype, "dx")
    assert_accurate(ws.grad, wd.grad, w_dtype, "dgamma")


RMS_INVALID = [
    ("weight shape", (4, 8), (7,), torch.float32, r"must equal the trailing dims"),
    ("x rank", (8,), (8,), torch.float32, r"2 to 8 dims"),
    ("weight dtype", (4, 8), (8,), torch.bfloat16, r"(weight|gamma) dtype bfloat16 must equal"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("what,xs,ws,wdtype,message", RMS_INVALID, ids=[c[0] for c in RMS_INVALID])
def test_rms_norm_invalid_inputs(path, what, xs, ws, wdtype, message):
    x = torch.randn(xs, dtype=torch.float16)
    with pytest.raises((ValueError, TypeError), match=message):
        rms(path, x, torch.ones(ws, dtype=wdtype), 1e-6)


def test_rms_norm_emulation_checks_itself():
    with pytest.raises(ValueError, match=r"npu_rms_norm: gamma shape \(7,\) must equal"):
        emulation.npu_rms_norm(torch.randn(3, 8), torch.ones(7))
    with pytest.raises(TypeError, match=r"npu_rms_norm: x dtype float64"):
        emulation.npu_rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.ones(8))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), hidden=st.integers(1, 64),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_layer_norm_matches_fp64_reference(dtype_name, lead, hidden, affine, seed):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, hidden)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    # a row whose variance is near eps is ill-conditioned (rstd ~ 1/sqrt(eps) amplifies the
    # rounding of every input); accuracy thresholds only make sense for conditioned rows
    assume(hidden == 1 or float(x.double().std(-1, unbiased=False).min()) > 0.1)
    w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype) if affine else None
    b = (0.3 * torch.randn(hidden, generator=gen)).to(dtype) if affine else None
    gy = torch.randn(shape, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y, mean, rstd = norm.layer_norm(leaves[0], *(leaves[1:] or [None, None]), eps=1e-5)
    y.backward(gy)

    refs = [t.double().requires_grad_() for t in (x, w, b) if t is not None]
    xd = refs[0]
    mu = xd.mean(-1, keepdim=True)
    var = ((xd - mu) ** 2).mean(-1, keepdim=True)
    ref_rstd = 1.0 / torch.sqrt(var + 1e-5)
    ref = (xd - mu) * ref_rstd
    if affine:
        ref = ref * refs[1] + refs[2]
    ref.backward(gy.double())

    assert_accurate(y, ref, dtype, "y")
    assert_accurate(mean, mu, dtype, "mean")
    assert_accurate(rstd, ref_rstd, dtype, "rstd")
    for got, want, name in zip(leaves, refs, ("dx", "dweight", "dbias")):
        assert_accurate(got.grad, want.grad, dtype, name)


def test_layer_norm_invalid_inputs():
    with pytest.raises(ValueError, match=r"weight shape \(5,\) must equal normalized_shape"):
        norm.layer_norm(torch.randn(2, 8), torch.ones(5), torch.zeros(8), normalized_shape=(8,))
    with pytest.raises(ValueError, match=r"normalized_shape \(3,\) must equal the trailing dims"):
        norm.layer_norm(torch.randn(2, 8), normalized_shape=(3,))
    with pytest.raises(TypeError, match=r"layer_norm: x dtype must be one of"):
        norm.layer_norm(torch.ones(2, 8, dtype=torch.int64))
