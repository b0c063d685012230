"""SwiGLU and bias-GELU: native, NPU binding on the emulation, and dispatcher vs plain fp64."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron_npu.parity.benchmark import level_of
from megatron_npu.parity.verdict import require_accurate

from megatron_npu.ops import gelu, swiglu
from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import (
    PATHS,
    native_kernels_around_each_test,  # noqa: F401
    run,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    half=st.integers(1, 24),
    dim_pick=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_swiglu_matches_fp64_reference(path, dtype_name, shape, half, dim_pick, seed):
    dtype = DTYPES[dtype_name]
    dim = dim_pick % (len(shape) + 1) - (len(shape) + 1)  # a negative dim of the full shape
    full = list(shape)
    full.insert(len(full) + 1 + dim, 2 * half)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(full, generator=gen) * 2).to(dtype)
    xs = x.clone().requires_grad_()
    y = run(path, swiglu.swiglu, swiglu.native_swiglu, swiglu.npu_swiglu, xs, dim)
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(gy)

    xd = x.double().requires_grad_()
    a, b = xd.narrow(dim, 0, half), xd.narrow(dim, half, half)
    ref = a / (1 + torch.exp(-a)) * b
    ref.backward(gy.double())
    assert y.dtype == dtype
    require_accurate(y, ref, dtype, "y")
    require_accurate(xs.grad, xd.grad, dtype, "dx")


@pytest.mark.parametrize("path", PATHS)
def test_swiglu_invalid_inputs(path):
    with pytest.raises(ValueError, match=r"size 5 along dim -1 must be even"):
        run(path, swiglu.swiglu, swiglu.native_swiglu, swiglu.npu_swiglu, torch.randn(3, 5), -1)
    with pytest.raises(ValueError, match=r"dim 4 out of range"):
        run(path, swiglu.swiglu, swiglu.native_swiglu, swiglu.npu_swiglu, torch.randn(3, 4), 4)
    with pytest.raises(TypeError, match=r"x dtype must be one of"):
        run(
            path,
            swiglu.swiglu,
            swiglu.native_swiglu,
            swiglu.npu_swiglu,
            torch.ones(3, 4, dtype=torch.int32),
            -1,
        )


def test_swiglu_emulation_checks_itself():
    with pytest.raises(ValueError, match=r"npu_swiglu: x size 3 along dim 0 must be even"):
        emulation.npu_swiglu(torch.randn(3, 4), dim=0)


def test_bias_swiglu_adds_bias_first():
    x, b = torch.randn(4, 8), torch.randn(8)
    torch.testing.assert_close(swiglu.bias_swiglu(x, b), swiglu.swiglu(x + b))


def gelu_reference(z: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


def bias_gelu(path, x, bias, approximate):
    return run(
        path, gelu.bias_gelu, gelu.native_bias_gelu, gelu.npu_bias_gelu, x, bias, approximate
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    hidden=st.integers(1, 40),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bias_gelu_matches_fp64_reference(
    path, dtype_name, approximate, lead, hidden, with_bias, seed
):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, hidden, generator=gen) * 3).to(dtype)
    bias = torch.randn(hidden, generator=gen).to(dtype) if with_bias else None
    gy = torch.randn(*lead, hidden, generator=gen).to(dtype)
    xs = x.clone().requires_grad_()
    bs = bias.clone().requires_grad_() if with_bias else None
    y = bias_gelu(path, xs, bs, approximate)
    y.backward(gy)

    def reference(dt):
        """The formula in ``dt``: fp64 is the reference, the tested dtype the benchmark."""
        xd = x.to(dt).requires_grad_()
        bd = bias.to(dt).requires_grad_() if with_bias else None
        out = gelu_reference(xd + bd if with_bias else xd, approximate)
        out.backward(gy.to(dt))
        return {"y": out, "dx": xd.grad, "dbias": bd.grad if with_bias else None}

    ref, bench = reference(torch.float64), reference(dtype)
    got = {"y": y, "dx": xs.grad, "dbias": bs.grad if with_bias else None}
    for name in ("y", "dx", "dbias") if with_bias else ("y", "dx"):
        require_accurate(
            got[name], ref[name], dtype, name, benchmark=bench[name], level=level_of("bias-gelu")
        )


@pytest.mark.parametrize("path", PATHS)
def test_bias_gelu_default_is_the_tanh_formula(path):
    z = torch.linspace(-4, 4, 101, dtype=torch.float64).float()
    y = bias_gelu(path, z, None, "tanh").double()
    torch.testing.assert_close(bias_gelu(path, z, None, "tanh"), gelu.bias_gelu(z))
    tanh_ref = gelu_reference(z.double(), "tanh")
    exact_ref = gelu_reference(z.double(), "none")
    assert (y - tanh_ref).abs().max() < 1e-6
    assert (y - exact_ref).abs().max() > 1e-4  # the two formulas really differ


@pytest.mark.parametrize("path", PATHS)
def test_bias_gelu_invalid_inputs(path):
    with pytest.raises(ValueError, match=r"approximate must be 'tanh' or 'none'"):
        bias_gelu(path, torch.randn(3), None, "fast")
    with pytest.raises(ValueError, match=r"bias shape \(4,\) must equal the trailing dims"):
        bias_gelu(path, torch.randn(2, 3), torch.randn(4), "tanh")


def test_gelu_emulation_checks_itself():
    with pytest.raises(ValueError, match=r"npu_gelu: approximate must be 'none' or 'tanh'"):
        emulation.npu_gelu(torch.randn(3), approximate="erf")
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # torch_npu's own doc example values for fast_gelu (A2 formula)
    torch.testing.assert_close(
        emulation.npu_fast_gelu(x),
        torch.tensor([0.8458, 1.9357, 2.9819, 3.9956]),
        atol=1e-4,
        rtol=0,
    )
