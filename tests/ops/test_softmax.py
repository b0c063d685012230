"""Scaled masked softmax (native, NPU binding on the emulation, dispatcher) and the fused-softmax
availability rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron_npu.parity.verdict import require_accurate

from megatron_npu.ops import softmax
from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import (
    PATHS,
    native_kernels_around_each_test,  # noqa: F401
    run,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def smx(path, x, mask, scale, causal):
    return run(
        path,
        softmax.scaled_masked_softmax,
        softmax.native_scaled_masked_softmax,
        softmax.npu_scaled_masked_softmax,
        x,
        mask,
        scale,
        causal,
    )


def reference(x, masked, scale):
    logits = x * scale
    if masked is not None:
        logits = torch.where(masked, torch.full_like(logits, -10000.0), logits)
    e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    heads=st.integers(1, 3),
    sq=st.sampled_from([32, 64, 96]),
    sk=st.sampled_from([32, 64, 128]),
    mask_kind=st.sampled_from([None, "b1", "11", "full"]),
    causal=st.booleans(),
    scale=st.sampled_from([1.0, 0.125, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_softmax_matches_fp64_reference(
    path, dtype_name, b, heads, sq, sk, mask_kind, causal, scale, seed
):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, heads, sq, sk, generator=gen) * 4).to(dtype)
    mshape = {None: None, "b1": (b, 1, sq, sk), "11": (1, 1, sq, sk), "full": (b, heads, sq, sk)}
    mask = None
    if mask_kind is not None:
        mask = torch.rand(mshape[mask_kind], generator=gen) < 0.3
        mask[..., 3, :] = True  # a fully masked row comes out uniform
    gy = torch.randn(b, heads, sq, sk, generator=gen).to(dtype)
    xs = x.clone().requires_grad_()
    y = smx(path, xs, mask, scale, causal)
    y.backward(gy)

    xd = x.double().requires_grad_()
    masked = None if mask is None else mask.expand(b, heads, sq, sk)
    if causal:
        tri = torch.arange(sk)[None, :] > torch.arange(sq)[:, None]
        masked = tri.expand(b, heads, sq, sk) if masked is None else masked | tri
    ref = reference(xd, masked, scale)
    ref.backward(gy.double())
    assert y.dtype == dtype
    require_accurate(y, ref, dtype, "y")
    require_accurate(xs.grad, xd.grad, dtype, "dx")
    if mask is not None and not causal:
        torch.testing.assert_close(
            y[..., 3, :].float(), torch.full_like(y[..., 3, :].float(), 1.0 / sk)
        )


INVALID = [
    ("sq small", (1, 1, 16, 64), None, ValueError, r"sq=16 must be in \[32, 4096\] and divisible"),
    ("sk big", (1, 1, 32, 4128), None, ValueError, r"sk=4128 must be in \[32, 4096\]"),
    ("sk not /32", (1, 1, 32, 48), None, ValueError, r"sk=48 must be .* divisible by 32"),
    ("rank", (2, 32, 32), None, ValueError, r"x must be 4-D"),
    (
        "mask dtype",
        (1, 1, 32, 32),
        torch.zeros(1, 1, 32, 32),
        TypeError,
        r"mask dtype must be bool",
    ),
    (
        "mask shape",
        (1, 2, 32, 32),
        torch.zeros(3, 1, 32, 32, dtype=torch.bool),
        ValueError,
        r"mask shape \(3, 1, 32, 32\) must broadcast",
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("what,shape,mask,exc,message", INVALID, ids=[c[0] for c in INVALID])
def test_softmax_invalid_inputs(path, what, shape, mask, exc, message):
    with pytest.raises(exc, match=message):
        smx(path, torch.randn(shape, dtype=torch.float16), mask, 1.0, False)


def test_softmax_emulation_checks_itself():
    x = torch.randn(1, 1, 32, 48)
    with pytest.raises(ValueError, match=r"npu_scaled_masked_softmax: x.shape\[-1\]=48"):
        emulation.npu_scaled_masked_softmax(x, torch.zeros(1, 1, 32, 48, dtype=torch.bool))
    x = torch.randn(1, 1, 32, 32)
    with pytest.raises(TypeError, match=r"npu_scaled_masked_softmax: mask dtype must be bool"):
        emulation.npu_scaled_masked_softmax(x, torch.zeros(32, 32), 1.0, True)


AVAILABILITY = [
    (torch.float16, 32, 32, True),
    (torch.bfloat16, 2048, 4096, True),  # Megatron's input_in_float16 covers bf16
    (torch.float32, 64, 64, False),  # fp32 goes to the torch softmax
    (torch.float16, 64, 16, False),
    (torch.float16, 64, 48, False),  # MindSpeed's rule (sk % 16) would say yes; the kernel says no
    (torch.float16, 16, 64, False),
    (torch.float16, 64, 4128, False),
    (torch.float16, 4096, 4096, True),
]


@pytest.mark.parametrize("dtype,sq,sk,expected", AVAILABILITY)
def test_fused_softmax_availability(dtype, sq, sk, expected):
    assert softmax.is_fused_softmax_available(dtype, 2, 3, sq, sk) is expected
    assert softmax.is_fused_softmax_available(dtype, 2, 3, sq, sk, fusion_enabled=False) is False
    if expected:  # whatever the rule admits, the kernel accepts
        x = torch.randn(1, 1, sq, sk, dtype=dtype)
        emulation.npu_scaled_masked_softmax(x, torch.zeros(1, 1, sq, sk, dtype=torch.bool))
