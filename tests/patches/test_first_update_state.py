"""``checkpoint.first-update-state*``: a distributed-optimizer save before any applied update
gives torch Adam(W)'s missing states the zeros of their first update. The reference for "the
zeros of their first update" is torch itself: an optimizer given them and then stepped ends
exactly where a fresh one that created its own state ends. The end-to-end case is
``tests/megatron_lm/test_pretrain_gpt.py::test_a_checkpoint_before_the_first_fp16_update_resumes``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_npu.optim.adamw import FusedAdamW
from megatron_npu.optim.first_update_state import give_missing_state
from megatron_npu.patches import checkpointing


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: FusedAdamW(ps, lr=1e-2),
    ],
    ids=["adam", "adamw", "amsgrad", "single-tensor", "fused", "adaptor-fused-adamw"],
)
def test_the_given_state_is_the_one_torch_creates_at_the_first_update(make):
    torch.manual_seed(0)
    start = [torch.randn(3, 4), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]

    def run(given: bool):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = make(params)
        if given:
            assert give_missing_state(opt)
            assert not give_missing_state(opt)  # nothing left to give
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return params, opt.state_dict()["state"]

    (ref, ref_state), (got, got_state) = run(False), run(True)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert ref_state.keys() == got_state.keys()
    for i in ref_state:
        assert ref_state[i].keys() == got_state[i].keys()
        for key, value in ref_state[i].items():
            assert value.dtype == got_state[i][key].dtype, key
            assert value.device == got_state[i][key].device, key
            assert torch.equal(value, got_state[i][key]), key


def _distopt(inner, **config):
    return SimpleNamespace(
        optimizer=inner,
        config=SimpleNamespace(
            **{"optimizer": "adam", "use_precision_aware_optimizer": False, **config}
        ),
    )


class _OtherLayoutAdam(torch.optim.Optimizer):
    """An Adam outside torch's classes (Transformer Engine's and apex's fused Adam keep other
    state layouts): never given torch's."""

    def __init__(self, params):
        super().__init__(params, {})


def _save_readers():
    """megatron-core's two save readers' signatures; each returns the states it saw."""

    def sharded_state_dict(
        self, model_sharded_state_dict=None, is_loading=False, sharding_type=None, metadata=None
    ):
        return {p: dict(s) for p, s in self.optimizer.state.items()}

    def get_parameter_state_dp_zero(
        self, use_gloo_comm=True, empty_data=False, return_on_all_ranks=False
    ):
        return {p: dict(s) for p, s in self.optimizer.state.items()}

    wrap = checkpointing._wrap_save_with_first_update_state
    return {"sharded": wrap(sharded_state_dict), "dp-zero": wrap(get_parameter_state_dp_zero)}


@pytest.mark.parametrize(
    "reader, asked, config, given",
    [
        ("sharded", {}, {}, True),
        ("sharded", {"is_loading": False}, {}, True),
        ("sharded", {"is_loading": True}, {}, False),  # a load template: the load fills it
        ("dp-zero", {}, {}, True),
        ("dp-zero", {"empty_data": True}, {}, False),  # a load template too
        ("sharded", {}, {"use_precision_aware_optimizer": True}, False),
        ("sharded", {}, {"other-layout": True}, False),
    ],
    ids=[
        "save",
        "save-keyword",
        "load-template",
        "legacy-save",
        "legacy-load-template",
        "precision-aware",
        "other-adam-layout",
    ],
)
def test_only_a_save_of_a_torch_adam_main_optimizer_is_given_state(reader, asked, config, given):
    param = torch.nn.Parameter(torch.zeros(4))
    other = config.pop("other-layout", False)
    inner = _OtherLayoutAdam([param]) if other else torch.optim.Adam([param])
    seen = _save_readers()[reader](_distopt(inner, **config), **asked)
    assert bool(seen.get(param)) == given
    if given:
        assert set(seen[param]) == {"step", "exp_avg", "exp_avg_sq"}
