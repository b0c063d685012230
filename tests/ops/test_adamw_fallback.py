"""No silent algorithm fallback in the native AdamW: a missing fused kernel is found by a probe,
named once by a FusedKernelFallbackWarning, recorded for ``megatron-npu info``; an error of the
real update is never swallowed into a different algorithm."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_npu.ops import adamw, fallbacks

REAL = torch._fused_adamw_


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(adamw, "_fused_available", {})
    monkeypatch.setattr(fallbacks, "_recorded", {})


def _tensors(dtype, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = [torch.randn(5, 4, generator=g).to(dtype) for _ in range(n)]
    return make, [torch.randn(5, 4, generator=g).to(dtype) for _ in range(n)]


def _step(params, grads, step=1):
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    adamw.native_adamw_step_(params, grads, m, v, step=step, lr=1e-3, weight_decay=0.1)
    return params


def _no_kernel_for(dtype):
    def fused(params, *args, **kwargs):
        if params[0].dtype == dtype:
            raise RuntimeError(f"_fused_adamw_ not implemented for '{dtype}'")
        return REAL(params, *args, **kwargs)

    return fused


def test_a_missing_fused_kernel_is_named_once_recorded_and_the_update_is_still_adamw(
    fresh, monkeypatch
):
    monkeypatch.setattr(torch, "_fused_adamw_", _no_kernel_for(torch.float16))
    params, grads = _tensors(torch.float16)
    expected = [p.clone() for p in params]
    with pytest.warns(
        fallbacks.FusedKernelFallbackWarning,
        match=r"torch\._fused_adamw_ "
        r"unavailable for cpu float16 params, float16 grads.*per-tensor fp32",
    ):
        _step(params, grads)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fallbacks.FusedKernelFallbackWarning)  # once only
        _step(*_tensors(torch.float16, seed=1))
    # the fallback computes AdamW: same as torch.optim.AdamW in fp32, rounded once
    for p, g, e in zip(params, grads, expected, strict=True):
        ref = e.float().clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1)
        ref.grad = g.float()
        opt.step()
        torch.testing.assert_close(p, ref.detach().to(torch.float16), rtol=0, atol=0)
    [row] = fallbacks.recorded()
    assert (row.op, row.kernel) == ("adamw_step", "torch._fused_adamw_")
    assert "not implemented for 'torch.float16'" in row.reason


def test_the_fallback_shows_in_info(fresh, monkeypatch):
    from megatron_npu import info

    monkeypatch.setattr(torch, "_fused_adamw_", _no_kernel_for(torch.bfloat16))
    data = info.collect("cpu")
    where = [row["where"] for row in data["fallbacks"]]
    assert "cpu bfloat16 params, bfloat16 grads, bfloat16/bfloat16 moments" in where
    assert all(row["kernel"] == "torch._fused_adamw_" for row in data["fallbacks"])


def test_an_error_of_the_real_update_is_not_swallowed(fresh, monkeypatch):
    calls = []

    def fused(params, *args, **kwargs):
        calls.append(len(params))
        if len(calls) > 1:  # the probe passes; the real update fails
            raise RuntimeError("device out of memory")
        return REAL(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", fused)
    with pytest.raises(RuntimeError, match="device out of memory"):
        _step(*_tensors(torch.float32))
    assert fallbacks.recorded() == []


def test_the_fused_update_makes_one_step_tensor_whatever_the_parameter_count(monkeypatch):
    """The fused kernel reads the step from a tensor per parameter; they are one tensor, made
    once per call (on a GPU a tensor made per parameter is a host-to-device copy each), and the
    update equals torch's AdamW at that step."""
    seen = []

    def fused(params, grads, m, v, vmax, steps, **kwargs):
        seen.append((len(params), len({id(s) for s in steps})))
        return REAL(params, grads, m, v, vmax, steps, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", fused)
    for count in (20, 80):
        params, grads = _tensors(torch.float32, n=count, seed=count)
        expected = [p.clone().requires_grad_() for p in params]
        reference = torch.optim.AdamW(expected, lr=1e-3, weight_decay=0.1, foreach=False)
        for p, g in zip(expected, grads, strict=True):
            p.grad = g.clone()
        reference.step()
        _step(params, grads)
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    assert [s for s in seen if s[0] > 1] == [(20, 1), (80, 1)]  # (a one-element probe first)
