"""Mixture-of-experts layouts compute the same model: per-step losses and aux losses within 1e-5.

fp32, dropout 0, no token dropping; each layout is a real multi-rank gloo run of
``python -m megatron_npu.train``. Equal figures need equal initial experts in every layout:
megatron_npu.training.model seeds each expert by its global index and cuts expert-TP shards by
the expert-TP rank. Plain EP2 is a row of the default compare matrix, judged by the same
layout rule there (tests/compare/test_default_matrix.py). The fused permutation on
npu-emulated is held to the same rule against the CPU's EP1 run.
"""

from __future__ import annotations

import pytest

from ._runner import TINY, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOLERANCE = 1e-5
STEPS = 8
#: 4 SwiGLU experts, top-2, alltoall dispatch, aux loss; 2 layers (every one an MoE layer)
MOE = [
    "--num-layers",
    "2",
    "--train-iters",
    str(STEPS),
    "--log-interval",
    "5",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--swiglu",
    "--disable-bias-linear",
]

LAYOUTS = {
    # experts spread over the TP ranks, whole within each (ETP1)
    "tp2-sp-ep2-etp1": [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
    ],
    # every expert split over the TP ranks (Megatron's default ETP = TP), EP1
    "tp2-sp-etp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    # EP2 on npu-emulated with the fused permutation: the torch_npu permute / unpermute kernels
    # must give the rows and sums of Megatron's unfused code on the CPU
    "ep2-permute-fusion-npu": [
        "--expert-model-parallel-size",
        "2",
        "--moe-permute-fusion",
        "--device",
        "npu-emulated",
    ],
}


@pytest.fixture(scope="module")
def moe_baseline(tmp_path_factory):
    return train(tmp_path_factory.mktemp("moe-ep1"), *TINY, *MOE, name="ep1")


def _figures(run) -> dict[int, tuple[float, float]]:
    return {s.step: (s.lm_loss, s.moe_aux_losses["load_balancing_loss"]) for s in run.steps}


def _aux_loss_over_the_same_tokens(layout: list[str]) -> bool:
    """Whether this layout's load-balancing loss is taken over the tokens the one-rank EP1 run
    takes it over. megatron-core 0.13 takes it over each data-parallel rank's own micro-batch
    (its router reduces only over TP x CP), so a layout with two data-parallel ranks (EP2 on
    TP1) logs, and trains on, another aux loss by Megatron's own definition; later releases
    take it over the data-parallel ranks' tokens together."""
    from packaging.version import Version

    from megatron_npu.patcher import megatron_core_version

    return "--tensor-model-parallel-size" in layout or (
        Version(megatron_core_version()) >= Version("0.14")
    )


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_layout_matches_ep1(tmp_path, moe_baseline, name):
    run = train(tmp_path, *TINY, *MOE, *LAYOUTS[name], nproc=2, name=name)
    base, other = _figures(moe_baseline), _figures(run)
    assert sorted(other) == sorted(base) == list(range(1, STEPS + 1))
    compared = 2 if _aux_loss_over_the_same_tokens(LAYOUTS[name]) else 1  # loss (and aux loss)
    worst = max(
        max(abs(a - b) for a, b in zip(base[s][:compared], other[s][:compared], strict=True))
        for s in base
    )
    print(f"\n{name}: max |loss or aux loss - EP1| over {STEPS} steps = {worst:.3e}")
    assert worst <= TOLERANCE, (base, other)
    assert base[STEPS][0] < base[1][0] - 0.1  # it learns
    assert all(0.9 < aux < 1.5 for _, aux in base.values())  # near 1: balanced routing
