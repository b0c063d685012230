"""Fused AdamW (native, NPU binding on the emulation, dispatcher) and the multi-tensor helpers
against plain fp64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron_npu.parity.metrics import dtype_config, dtype_name
from megatron_npu.parity.verdict import Tolerance, judge, require_accurate

from megatron_npu.ops import adamw, multi_tensor
from megatron_npu.testing import torch_npu_emulation as emulation

from ._paths import (
    PATHS,
    native_kernels_around_each_test,  # noqa: F401
    run,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: realistic learning rates (GPT pretraining uses 1e-4 .. 6e-4): the update of a parameter is
#: then about lr, small against the parameter itself
LRS = (1e-4, 3e-4)
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8)
#: parameter magnitude per dtype: storing the new parameter rounds it by half a spacing at |p|,
#: which must stay well below the update (~lr) for a wrong update to be visible at all. fp32
#: keeps unit weights (spacing 1.2e-7); a 16-bit parameter of magnitude 1 has a spacing (1e-3 /
#: 8e-3) far above any realistic update, so 16-bit parameters are drawn small enough that their
#: spacing is about 1e-6, as a weight of that size would be.
PARAM_SCALE = {torch.float32: 1.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-13}


def step(path, *lists, **kw):
    return run(
        path, adamw.adamw_step_, adamw.native_adamw_step_, adamw.npu_adamw_step_, *lists, **kw
    )


def reference_step(p, m, v, vmax, g, t, wd, amsgrad, maximize, lr, beta1, beta2, eps):
    """One plain fp64 AdamW step (t = step after the update) from the given state."""
    p, m, v, g = p.double(), m.double(), v.double(), g.double()
    if maximize:
        g = -g
    p = p * (1 - lr * wd)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    vmax = torch.maximum(vmax.double(), v) if amsgrad else None
    m_hat = m / (1 - beta1**t)
    v_hat = (vmax if amsgrad else v) / (1 - beta2**t)
    p = p - lr * m_hat / (torch.sqrt(v_hat) + eps)
    return p, m, v, vmax


def spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between ``dtype`` values around each |x| (one ULP, as
    megatron_npu.parity.metrics counts it: 2**(e - mantissa bits), e = max(floor(log2 |x|), the
    dtype's least exponent))."""
    cfg = dtype_config(dtype)
    a = x.double().abs()
    e = torch.where(a > 0, torch.floor(torch.log2(torch.where(a > 0, a, 1.0))), 0.0)
    return torch.exp2(torch.clamp(e, min=cfg.ulp_min_exponent) - cfg.mantissa_bits)


def judge_update(new, old, ref_new, dtype, roundings=2):
    """The parity verdict of the *update* ``new - old`` against the fp64 update ``ref_new - old``.

    The update is what AdamW computes (in fp32 on every path), so it is judged by the fp32
    rules; their relative L2 bound is raised only by what storing the parameter may cost: per
    step two roundings (the decayed parameter, then the updated one) of at most one spacing of
    the dtype each (half a spacing, doubled for a result in the binade below the reference),
    relative to the update's norm. With unit fp32 weights and lr 1e-4 that is about 2e-3 of the
    update, so an update wrong by 1 % fails; judged as a tensor (norm ~1), the parameter would
    pass it (max abs error ~1e-6 < 1e-3, relative L2 1e-6 within fp32's bound).
    """
    delta = new.double() - old.double()
    want = ref_new.double() - old.double()
    storage = float((roundings * spacing(ref_new, dtype)).norm())
    bound = dtype_config(torch.float32).rel_l2_bound + storage / max(float(want.norm()), 1e-300)
    tolerance = Tolerance(
        reason=f"the parameter is stored in {dtype_name(dtype)}: {roundings} rounding(s) of one "
        "spacing each, relative to the update",
        rel_l2=bound,
    )
    return judge(delta, want, torch.float32, tolerance=tolerance)


def require_update(new, old, ref_new, dtype, what, roundings=2):
    verdict = judge_update(new, old, ref_new, dtype, roundings)
    assert verdict.status != "error", f"{what}: {verdict.reason}"


def draw_params(shapes, dtype, gen):
    return [(torch.randn(s, generator=gen) * PARAM_SCALE[dtype]).to(dtype) for s in shapes]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=3),
    steps=st.integers(1, 3),
    wd=st.sampled_from([0.0, 0.1]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    lr=st.sampled_from(LRS),
    seed=st.integers(0, 2**16),
)
def test_adamw_matches_fp64_reference(
    path, dtype_name, shapes, steps, wd, amsgrad, maximize, lr, seed
):
    """Each step against fp64 from the same (stored) state, as msprobe checks one call: the
    parameter by its update (:func:`judge_update`), the moments by the verdict; fp32 also
    against the fp64 trajectory (16-bit state storage drifts by design over steps)."""
    dtype = DTYPES[dtype_name]
    hp = dict(HP, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    params = draw_params(shapes, dtype, gen)
    start = [p.clone() for p in params]
    m = [torch.zeros_like(t) for t in params]
    v = [torch.zeros_like(t) for t in params]
    vmax = [torch.zeros_like(t) for t in params] if amsgrad else None
    zeros = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    trajectory = [(t.double(), z, z, z) for t, z in zip(params, zeros, strict=True)]
    for t in range(1, steps + 1):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        before = [
            (params[i], m[i], v[i], vmax[i] if amsgrad else zeros[i]) for i in range(len(shapes))
        ]
        expected = [
            reference_step(*state, grads[i], t, wd, amsgrad, maximize, **hp)
            for i, state in enumerate(before)
        ]
        trajectory = [
            reference_step(*state, grads[i], t, wd, amsgrad, maximize, **hp)
            for i, state in enumerate(trajectory)
        ]
        trajectory = [
            (p, m_, v_, zeros[i] if vm is None else vm)
            for i, (p, m_, v_, vm) in enumerate(trajectory)
        ]
        old = params
        params = [p.clone() for p in params]
        m, v = [x.clone() for x in m], [x.clone() for x in v]
        vmax = [x.clone() for x in vmax] if amsgrad else None
        step(
            path,
            params,
            grads,
            m,
            v,
            step=t,
            weight_decay=wd,
            amsgrad=amsgrad,
            maximize=maximize,
            max_exp_avg_sqs=vmax,
            **hp,
        )
        for i, (ref_p, ref_m, ref_v, ref_vmax) in enumerate(expected):
            assert params[i].dtype == dtype
            require_update(params[i], old[i], ref_p, dtype, f"step {t} param[{i}]")
            require_accurate(m[i], ref_m, dtype, f"step {t} exp_avg[{i}]")
            require_accurate(v[i], ref_v, dtype, f"step {t} exp_avg_sq[{i}]")
            if amsgrad:
                require_accurate(vmax[i], ref_vmax, dtype, f"step {t} max_exp_avg_sq[{i}]")
    if dtype == torch.float32:
        for i, (ref_p, ref_m, ref_v, _) in enumerate(trajectory):
            require_update(
                params[i], start[i], ref_p, dtype, f"trajectory param[{i}]", roundings=2 * steps
            )
            require_accurate(m[i], ref_m, dtype, f"trajectory exp_avg[{i}]")
            require_accurate(v[i], ref_v, dtype, f"trajectory exp_avg_sq[{i}]")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("lr", LRS)
@pytest.mark.parametrize("wrong", [1.1, 0.9])
def test_an_update_wrong_by_ten_percent_is_rejected(path, dtype_name, lr, wrong):
    """The check above can fail where it matters: AdamW run with a learning rate 10 % off (an
    update 10 % too large or too small, e.g. a wrong bias correction) is an error for every
    dtype and realistic lr, while the same run with the right lr passes."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(5)
    shapes = [(64, 16), (16,)]
    params = draw_params(shapes, dtype, gen)
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    zeros = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for scale, verdict in ((1.0, "pass"), (wrong, "error")):
        new = [p.clone() for p in params]
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        step(path, new, grads, m, v, step=1, weight_decay=0.1, **dict(HP, lr=lr * scale))
        for i, p in enumerate(params):
            ref_p = reference_step(
                p, zeros[i], zeros[i], None, grads[i], 1, 0.1, False, False, lr=lr, **HP
            )[0]
            got = judge_update(new[i], p, ref_p, dtype)
            assert (got.status == "error") == (verdict == "error"), (scale, i, got)
            if verdict == "error":
                assert got.rule == "rel_l2"


def test_npu_apply_adam_w_beta_power_convention():
    """The op multiplies the powers by beta itself: beta**(step-1) gives torch's AdamW."""
    torch.manual_seed(0)
    p = torch.randn(10)
    g = [torch.randn(10) for _ in range(3)]
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    var, m, v = p.clone(), torch.zeros(10), torch.zeros(10)
    var_wrong, m_w, v_w = p.clone(), torch.zeros(10), torch.zeros(10)
    for t in range(1, 4):
        ref.grad = g[t - 1].clone()
        opt.step()
        emulation.npu_apply_adam_w(
            0.9 ** (t - 1),
            0.95 ** (t - 1),
            0.1,
            0.05,
            0.9,
            0.95,
            1e-8,
            g[t - 1],
            None,
            False,
            False,
            out=(var, m, v),
        )
        emulation.npu_apply_adam_w(
            0.9**t,
            0.95**t,
            0.1,
            0.05,
            0.9,
            0.95,
            1e-8,
            g[t - 1],
            None,
            False,
            False,
            out=(var_wrong, m_w, v_w),
        )
    torch.testing.assert_close(var, ref.detach(), rtol=1e-5, atol=1e-6)
    assert (var_wrong - ref.detach()).abs().max() > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_adamw_invalid_inputs(path):
    p, g = [torch.randn(3)], [torch.randn(3)]
    m, v = [torch.zeros(3)], [torch.zeros(3)]
    with pytest.raises(ValueError, match=r"step must be an int >= 1"):
        step(path, p, g, m, v, step=0, lr=LRS[0], **HP)
    with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\)"):
        step(path, p, g, m, v, step=1, lr=0.1, beta1=1.0)
    with pytest.raises(ValueError, match=r"grads\[0\] shape \(4,\) differs from params\[0\]"):
        step(path, p, [torch.randn(4)], m, v, step=1, lr=LRS[0], **HP)
    with pytest.raises(ValueError, match=r"amsgrad=True needs max_exp_avg_sqs"):
        step(path, p, g, m, v, step=1, amsgrad=True, lr=LRS[0], **HP)
    with pytest.raises(ValueError, match=r"exp_avgs has 0 tensors, params has 1"):
        step(path, p, g, [], v, step=1, lr=LRS[0], **HP)


def test_adam_w_emulation_checks_itself():
    var = torch.randn(3)
    with pytest.raises(ValueError, match=r"npu_apply_adam_w: grad shape \(4,\) differs from var"):
        emulation.npu_apply_adam_w(
            1.0,
            1.0,
            0.1,
            0.0,
            0.9,
            0.99,
            1e-8,
            torch.randn(4),
            None,
            False,
            False,
            out=(var, torch.zeros(3), torch.zeros(3)),
        )
    with pytest.raises(ValueError, match=r"amsgrad=True needs max_grad_norm"):
        emulation.npu_apply_adam_w(
            1.0,
            1.0,
            0.1,
            0.0,
            0.9,
            0.99,
            1e-8,
            torch.randn(3),
            None,
            True,
            False,
            out=(var, torch.zeros(3), torch.zeros(3)),
        )


# ----------------------------------------------------------------------------- multi-tensor


@settings(max_examples=30, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.lists(st.integers(1, 9), min_size=1, max_size=3), st.sampled_from(list(DTYPES))
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**16),
)
def test_multi_tensor_l2norm_matches_fp64_reference(specs, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(s, generator=gen) * 10).to(DTYPES[d]) for s, d in specs]
    total, per = multi_tensor.multi_tensor_l2norm(tensors, per_tensor=True)
    ref_per = torch.stack([t.double().pow(2).sum().sqrt() for t in tensors])
    ref_total = ref_per.pow(2).sum().sqrt().reshape(1)
    assert total.dtype == per.dtype == torch.float32 and total.shape == (1,)
    require_accurate(per, ref_per, torch.float32, "per-tensor norms")
    require_accurate(total, ref_total, torch.float32, "total norm")
    assert multi_tensor.multi_tensor_l2norm(tensors)[1] is None


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
def test_multi_tensor_scale_and_unscale(dtype_name, poison):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(5, 3, generator=gen).to(dtype), torch.randn(7, generator=gen).to(dtype)]
    if poison is not None:
        src[1][4] = poison
    ref = [t.double() * 0.25 for t in src]
    dst = [torch.empty_like(t) for t in src]
    found = multi_tensor.multi_tensor_scale_(src, dst, 0.25)
    assert found.item() == (0.0 if poison is None else 1.0)
    for got, want in zip(dst, ref, strict=True):
        require_accurate(got, want, dtype, "scaled")
    inplace = [t.clone() for t in src]
    found = multi_tensor.multi_tensor_scale_(inplace, inplace, 0.25)  # Megatron's [grads, grads]
    assert found.item() == (0.0 if poison is None else 1.0)
    for got, want in zip(inplace, ref, strict=True):
        require_accurate(got, want, dtype, "scaled in place")
    again = [t.clone() for t in src]
    found = multi_tensor.check_finite_and_unscale_(again, torch.tensor(0.5))
    assert found.item() == (0.0 if poison is None else 1.0)
    for got, want in zip(again, src, strict=True):
        require_accurate(got, want.double() * 0.5, dtype, "unscaled")


def test_multi_tensor_invalid_inputs():
    with pytest.raises(TypeError, match=r"tensors\[1\] dtype must be one of"):
        multi_tensor.multi_tensor_l2norm([torch.randn(2), torch.ones(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"src\[0\] shape \(2,\) differs from dst\[0\] \(3,\)"):
        multi_tensor.multi_tensor_scale_([torch.randn(2)], [torch.randn(3)], 2.0)
    with pytest.raises(ValueError, match=r"src has 1 tensors, dst has 0"):
        multi_tensor.multi_tensor_scale_([torch.randn(2)], [], 2.0)
    total, per = multi_tensor.multi_tensor_l2norm([], per_tensor=True)
    assert total.item() == 0.0 and per.numel() == 0
