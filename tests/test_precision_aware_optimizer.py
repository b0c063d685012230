"""The precision-aware AdamW (TE FusedAdam's contract behind ``--use-precision-aware-optimizer``):
the remainder encoding, the states in their dtypes against torch's AdamW, checkpoint round
trips, and megatron-core's config and factory building it without TE."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_npu.optim.adamw import FusedAdamW
from megatron_npu.optim.precision_aware import (
    MegatronAdam,
    PrecisionAwareAdamW,
    join_master,
    split_master,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64))
def test_remainders_give_the_fp32_master_back_exactly(patterns):
    bits = torch.tensor(patterns, dtype=torch.int32)
    # plant the rounding boundaries: low halves 0x7FFF, 0x8000 (a tie) and 0x8001
    bits = torch.cat([bits, (bits & ~0xFFFF) | 0x7FFF, (bits & ~0xFFFF) | 0x8000])
    bits = torch.cat([bits, (bits & ~0xFFFF) | 0x8001])
    master = bits.view(torch.float32)
    finite = torch.isfinite(master) & torch.isfinite(master.double().bfloat16().float())
    master = master[finite]
    param, remainder = split_master(master)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_master(param, remainder).view(torch.int32), master.view(torch.int32))
    # the parameter is the master rounded to nearest; an exact tie rounds away from zero
    low = master.view(torch.int32) & 0xFFFF
    tie = low == 0x8000
    nearest = master.bfloat16()
    assert torch.equal(param[~tie].view(torch.int16), nearest[~tie].view(torch.int16))
    assert torch.all(param[tie].float().abs() > master[tie].abs())


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((33,), (4, 9))]


def _grads(params, step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(dtype) for p in params]


_HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _reference(params, steps, grad_dtype):
    """torch.optim.AdamW in fp64 on the same starting values and (rounded) grads."""
    ref = [torch.nn.Parameter(p.detach().double()) for p in params]
    opt = torch.optim.AdamW(ref, **_HYPER)
    for step in range(steps):
        for r, g in zip(ref, _grads(params, step, grad_dtype), strict=True):
            r.grad = g.double()
        opt.step()
    return ref, opt


_STEPS = 3
#: the unit roundoff of a stored state (fp16 states are scaled into fp16's range first)
_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def _master_limit(master: str, moments: str, largest: float) -> float:
    """How far the master may sit from fp64 AdamW: the master's own storage rounding (an fp16
    master, relative to the largest value its scale covers) plus, per step, the update's error
    from rounded moments (lr x a few roundoffs: the update divides m by sqrt(v), each rounded)."""
    storage = 1e-6 if master != "fp16" else 2 * _ROUNDOFF["float16"] * largest
    return storage + _STEPS * _HYPER["lr"] * 4 * _ROUNDOFF[moments]


@pytest.mark.parametrize("moments", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("master", ["fp32", "fp32-remainders", "fp16"])
def test_states_keep_their_dtypes_and_follow_fp64_adamw(master, moments):
    moment_dtype = getattr(torch, moments)
    params = _params(torch.bfloat16)
    start = [p.detach().clone() for p in params]
    opt = MegatronAdam(
        params,
        **_HYPER,
        master_weights=True,
        master_weight_dtype=torch.float16 if master == "fp16" else torch.float32,
        exp_avg_dtype=moment_dtype,
        exp_avg_sq_dtype=moment_dtype,
        use_decoupled_grad=True,
        store_param_remainders=master == "fp32-remainders",
    )
    assert type(opt) is PrecisionAwareAdamW and isinstance(opt, torch.optim.AdamW)
    for step in range(_STEPS):
        for p, g in zip(params, _grads(params, step, torch.bfloat16), strict=True):
            p.decoupled_grad = g
        opt.step()
    ref, ref_opt = _reference(start, _STEPS, torch.bfloat16)
    master_dtype = {"fp32": torch.float32, "fp32-remainders": torch.int16, "fp16": torch.float16}
    for p, r in zip(params, ref, strict=True):
        state = opt.state[p]
        assert state["master_param"].dtype == master_dtype[master]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == moment_dtype
        full = opt.get_unscaled_state(p, "master_param")
        full = join_master(p.detach(), full) if full.dtype == torch.int16 else full
        assert full.dtype == torch.float32
        # the bf16 parameter is its master rounded
        assert torch.equal(p.detach().float(), full.bfloat16().float()) or master != "fp32"
        limit = _master_limit(master, moments, r.detach().abs().max().item())
        assert torch.allclose(full.double(), r.detach(), rtol=0, atol=limit), (
            (full.double() - r.detach()).abs().max()
        )
        for name in ("exp_avg", "exp_avg_sq"):
            # each step rounds the stored moment once, relative to its largest element at worst
            expected = ref_opt.state[r][name]
            limit = _STEPS * 2 * _ROUNDOFF[moments] * expected.abs().max().item() + 1e-12
            got = opt.get_unscaled_state(p, name).double()
            assert torch.allclose(got, expected, rtol=0, atol=limit), (name, got - expected)


def test_fp32_states_are_the_fused_adamw_bitwise():
    """fp32 params, fp32 master and moments: the same update as the fused AdamW."""
    plain_params, aware_params = _params(torch.float32), _params(torch.float32)
    plain = FusedAdamW(plain_params, **_HYPER)
    aware = MegatronAdam(aware_params, **_HYPER, master_weights=True, use_decoupled_grad=True)
    for step in range(3):
        for p, q, g in zip(
            plain_params, aware_params, _grads(plain_params, step, torch.float32), strict=True
        ):
            p.grad, q.decoupled_grad = g, g.clone()
        plain.step()
        aware.step()
    for p, q in zip(plain_params, aware_params, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(plain.state[p]["exp_avg_sq"], aware.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float16])
def test_state_dict_round_trip_continues_bitwise(moments):
    def build(params):
        return MegatronAdam(
            params,
            **_HYPER,
            master_weights=True,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=moments,
            use_decoupled_grad=True,
            store_param_remainders=True,
        )

    params = _params(torch.bfloat16)
    opt = build(params)

    def step(opt, params, n):
        for p, g in zip(params, _grads(params, n, torch.bfloat16), strict=True):
            p.decoupled_grad = g
        opt.step()

    step(opt, params, 0)
    saved = opt.state_dict()
    assert {v.dtype for k, v in saved["state"][0].items() if k != "step"} == {
        torch.float32,
        torch.int16,
    }
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = build(copies)
    loaded.load_state_dict(saved)
    for n in (1, 2):
        step(opt, params, n)
        step(loaded, copies, n)
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opt.state[p][name], loaded.state[q][name]), name


def test_remainders_come_back_from_an_fp32_checkpoint_exactly():
    """Megatron's fully_reshardable optimizer format holds the int16 remainders as fp32: they are
    stored back as the same int16 values; fp32 values that are no int16 value are an error."""
    params = _params(torch.bfloat16)
    opt = MegatronAdam(params, master_weights=True, store_param_remainders=True)
    remainders = torch.randint(-(2**15), 2**15, params[0].shape, dtype=torch.int16)
    opt.set_scaled_state(params[0], "master_param", remainders.float())
    assert torch.equal(opt.get_unscaled_state(params[0], "master_param"), remainders)
    with pytest.raises(TypeError, match="not int16 values"):
        opt.set_scaled_state(params[0], "master_param", remainders.float() + 0.5)


def test_grads_it_would_not_read_are_one_named_error():
    """Grads in ``decoupled_grad`` for an optimizer built to read ``.grad`` (megatron-core 0.13's
    factory without Megatron-LM's fp8 recipe) would leave every parameter as it is."""
    params = _params(torch.bfloat16)
    opt = MegatronAdam(params, exp_avg_dtype=torch.bfloat16)
    for p, g in zip(params, _grads(params, 0, torch.bfloat16), strict=True):
        p.decoupled_grad = g
    with pytest.raises(RuntimeError, match="arrive in decoupled_grad"):
        opt.step()


def test_fp8_moments_are_refused_by_name():
    with pytest.raises(ValueError, match="exp_avg_sq_dtype=torch.uint8"):
        MegatronAdam(_params(torch.bfloat16), exp_avg_sq_dtype=torch.uint8, master_weights=True)


def _precision_aware_config():
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        bf16=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        main_grads_dtype=torch.bfloat16,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        # Megatron-LM's default: megatron-core 0.13's factory hands the optimizer the master
        # weights only with it
        fp8_recipe="delayed",
    )


def test_megatron_builds_it_for_the_precision_aware_config(gloo_world_of_one, cpu_adaptor):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(8, 8, dtype=torch.bfloat16)

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    model = DistributedDataParallel(config, ddp, Tiny())
    opt = get_megatron_optimizer(_precision_aware_config(), [model]).optimizer
    assert isinstance(opt, PrecisionAwareAdamW)
    assert opt.use_decoupled_grad and opt.master_weights and opt.store_param_remainders
    assert opt.dtypes["exp_avg"] == opt.dtypes["exp_avg_sq"] == torch.bfloat16


def test_without_the_adaptor_megatron_asks_for_transformer_engine():
    import megatron_npu

    megatron_npu.apply("cpu")
    megatron_npu.restore()
    with pytest.raises((RuntimeError, TypeError)):
        _precision_aware_config()
