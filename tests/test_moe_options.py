"""The mixture-of-experts option rule: every broken combination named, valid ones pass."""

from __future__ import annotations

import pytest

from megatron_npu.moe_options import moe_option_problems

VALID = dict(
    num_experts=8, topk=2, ep=2, etp=None, tp=2, pp=1, world_size=8, sequence_parallel=True
)


def test_a_valid_layout_has_no_problem():
    assert moe_option_problems(**VALID) == []
    assert moe_option_problems(**{**VALID, "etp": 1, "ep": 4}) == []  # ETP1 x EP4 over 8 ranks
    assert moe_option_problems(**{**VALID, "num_experts": None, "ep": 1}) == []  # dense model


@pytest.mark.parametrize(
    "change, named",
    [
        ({"topk": 9}, "--moe-router-topk 9"),
        ({"topk": 0}, "--moe-router-topk 0"),
        ({"ep": 3, "world_size": 12}, "does not divide --num-experts 8"),
        ({"ep": 4, "tp": 1, "world_size": 6}, "does not divide the 6 ranks"),
        ({"ep": 2, "etp": 2, "pp": 2, "world_size": 4}, "= 8 ranks per expert replica"),
        ({"num_experts": None}, "--expert-model-parallel-size 2: needs --num-experts"),
        ({"num_experts": 0, "ep": 1}, "--num-experts 0"),
        ({"sequence_parallel": False}, "needs --sequence-parallel"),
    ],
)
def test_each_broken_combination_is_named(change, named):
    problems = moe_option_problems(**{**VALID, **change})
    assert len(problems) == 1 and named in problems[0], problems


def test_several_problems_are_all_named():
    problems = moe_option_problems(**{**VALID, "topk": 12, "ep": 3})
    assert len(problems) == 3, problems  # top-k, EP vs experts, EP x TP vs ranks
