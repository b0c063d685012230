"""The NPU AdamW launches a fixed handful of kernels per step, not one per parameter: counted
through the torch_npu emulation (``npu_apply_adam_w`` calls) and the profiler (every aten op the
op layer runs), and checked against torch.optim.AdamW."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import megatron_npu
from megatron_npu.ops import adamw
from megatron_npu.optim.adamw import FusedAdamW
from megatron_npu.testing import torch_npu_emulation as emulation

SHAPES = [(7, 3), (5,), (4, 2, 2), (1,), (6, 6)]


def _params(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPES[i % len(SHAPES)], generator=g) for i in range(n)]


def _lists(n, seed=0):
    params = _params(n, seed)
    grads = _params(n, seed + 1)
    return (
        params,
        grads,
        [torch.zeros_like(p) for p in params],
        [torch.zeros_like(p) for p in params],
    )


#: ops that only make a new view of existing memory: no kernel runs for them
_METADATA_ONLY = {
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::split",
    "aten::split_with_sizes",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::expand",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::_unsafe_view",
}


def _launches(fn):
    """Top-level aten ops that compute (the kernels a device would launch), by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(
        e.name
        for e in prof.events()
        if e.cpu_parent is None and e.name.startswith("aten::") and e.name not in _METADATA_ONLY
    )


@pytest.mark.parametrize("n", [3, 40])
def test_one_kernel_call_per_step_whatever_the_parameter_count(n):
    lists = _lists(n)
    with emulation.count_kernel_calls() as calls:
        adamw.npu_adamw_step_(emulation, *lists, step=1, lr=1e-3)
    assert calls == {"npu_apply_adam_w": 1}


def test_the_launches_of_a_step_do_not_grow_with_the_parameter_count():
    def ops(n):
        lists = _lists(n)
        return _launches(lambda: adamw.npu_adamw_step_(emulation, *lists, step=2, lr=1e-3))

    few, many = ops(4), ops(60)
    assert few == many, (few, many)
    # gathered operands (params, grads, both moments) and one multi-tensor copy back; the rest is
    # the emulated kernel's own arithmetic
    assert few["aten::cat"] == 4 and few["aten::_foreach_copy_"] == 1


def test_large_groups_are_cut_into_chunks_at_tensor_boundaries(monkeypatch):
    monkeypatch.setattr(adamw, "NPU_CHUNK_ELEMENTS", 50)
    lists = _lists(10)  # sizes 21, 5, 16, 1, 36, twice
    assert adamw.element_chunks(list(range(10)), lists[0], 50) == [
        [0, 1, 2, 3],
        [4],
        [5, 6, 7, 8],
        [9],
    ]
    expected = [p.clone() for p in lists[0]], [g.clone() for g in lists[1]]
    with emulation.count_kernel_calls() as calls:
        adamw.npu_adamw_step_(emulation, *lists, step=1, lr=1e-3)
    assert calls["npu_apply_adam_w"] == 4
    reference = _lists(10)
    adamw.native_adamw_step_(*reference, step=1, lr=1e-3)
    assert all(torch.equal(g, e) for g, e in zip(lists[1], expected[1], strict=True))
    for got, want in zip(lists[0], reference[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_fused_adamw_on_npu_emulated_matches_torch_adamw_over_steps(amsgrad, maximize):
    """Flat moments (FusedAdamW's), gathered params and grads: same numbers as torch's AdamW."""
    ours, ref = _params(9), _params(9)
    options = dict(
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize
    )
    megatron_npu.apply("npu-emulated")
    try:
        opt = FusedAdamW(ours, **options)
        torch_opt = torch.optim.AdamW(ref, foreach=False, **options)
        for step in range(4):
            grads = _params(9, seed=10 + step)
            for p, q, g in zip(ours, ref, grads, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            with emulation.count_kernel_calls() as calls:
                opt.step()
            torch_opt.step()
            assert calls["npu_apply_adam_w"] == 1
            for p, q in zip(ours, ref, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        moments = [opt.state[p]["exp_avg"] for p in ours]
        assert adamw.flat_view(moments) is not None  # back to back in one buffer
    finally:
        megatron_npu.restore()


def test_loaded_moments_are_packed_and_keep_their_values():
    params = _params(4)
    for p, g in zip(params, _params(4, seed=3), strict=True):
        p.grad = g
    opt = FusedAdamW(params, lr=1e-3)
    opt.step()
    state = opt.state_dict()
    fresh = _params(4)
    for p, q in zip(fresh, params, strict=True):
        p.data.copy_(q)
        p.grad = q.grad.clone()
    again = FusedAdamW(fresh, lr=1e-3)
    again.load_state_dict(state)  # torch gives each moment its own tensor
    saved = [again.state[p]["exp_avg_sq"].clone() for p in fresh]
    again._pack_moments(fresh, amsgrad=False)
    packed = [again.state[p]["exp_avg_sq"] for p in fresh]
    assert adamw.flat_view(packed) is not None
    for a, b in zip(packed, saved, strict=True):
        assert torch.equal(a, b)
