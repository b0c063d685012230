"""Context-parallel layouts of ``megatron-npu train`` compute the same model as one rank holding
the whole sequence: CP2 with each ``--cp-comm-type`` (``p2p`` also on npu-emulated through the
fused-attention kernels), CP2 beside TP + SP, PP and DP with the distributed optimizer,
hierarchical CP4 (``a2a+p2p``, 2 x 2), a Llama-style model (RoPE, GQA) on the ring and on the
NPU path's a2a, and a sliding window through the all-gather and the NPU path's a2a, against CP1
at the same global batch -- per-step losses within 1e-5, fp32, dropout 0.

Each layout is a real multi-rank gloo run of ``python -m megatron_npu.train`` with Megatron's
Transformer Engine layer spec (context parallelism runs through TE's attention). The batch of
each CP rank is cut by Megatron's own ``get_batch_on_this_cp_rank``.
"""

from __future__ import annotations

import pytest
from tiers import with_extended

from ._runner import TINY, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOLERANCE = 1e-5
STEPS = 4
COMMON = [
    "--transformer-impl",
    "transformer_engine",
    "--train-iters",
    str(STEPS),
    "--log-interval",
    "1",
]


def _cp(comm: str) -> list[str]:
    return ["--context-parallel-size", "2", "--cp-comm-type", comm]


#: Llama-style attention: rotary positions (each chunk at its true positions: Megatron's
#: RotaryEmbedding cuts the frequencies per CP rank) and grouped-query heads
LLAMA = ("--position-embedding-type", "rope", "--num-query-groups", "2")

#: a causal sliding window of 16 tokens (the fused attention's --pre-tokens): the all-to-all and
#: the all-gathered keys and values serve it, the ring refuses it at parse time
WINDOW = ("--use-flash-attn", "--pre-tokens", "16", "--next-tokens", "0")

#: name -> (ranks, model options (the CP1 run has them too), layout options)
LAYOUTS = {
    "cp2-p2p": (2, (), _cp("p2p")),
    "cp2-a2a": (2, (), _cp("a2a")),
    "cp2-allgather": (2, (), _cp("allgather")),
    # the ring on the NPU path: npu_fusion_attention blocks merged by npu_ring_attention_update
    "cp2-p2p-flash-npu": (2, (), [*_cp("p2p"), "--device", "npu-emulated", "--use-flash-attn"]),
    "tp2-sp-cp2-p2p": (
        4,
        (),
        [*_cp("p2p"), "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ),
    "pp2-cp2-a2a": (4, (), [*_cp("a2a"), "--pipeline-model-parallel-size", "2"]),
    "dp2-cp2-allgather-distopt": (4, (), [*_cp("allgather"), "--use-distributed-optimizer"]),
    # hierarchical: an all-to-all within pairs of ranks, a ring over the two pairs (CP4)
    "cp4-a2a-p2p": (
        4,
        (),
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
        ],
    ),
    "rope-gqa-cp2-p2p": (2, LLAMA, _cp("p2p")),
    "window-cp2-allgather": (2, WINDOW, _cp("allgather")),
    "window-cp2-a2a-npu": (2, WINDOW, [*_cp("a2a"), "--device", "npu-emulated"]),
    "rope-gqa-cp2-a2a-flash-npu": (
        2,
        LLAMA,
        [*_cp("a2a"), "--device", "npu-emulated", "--use-flash-attn"],
    ),
}
#: ``--extended``: CP beside the other parallel dimensions, the NPU path's kernels (which
#: tests/ops/test_context_parallel.py checks against whole-sequence attention), the plain CP2
#: ring, all-to-all and all-gather, which cp4-a2a-p2p (an all-to-all within pairs, a ring across
#: them) and window-cp2-allgather reach by default (the all-gather without a window is one of the
#: op test's cases), and the Llama-style ring, which
#: tests/megatron_lm/test_pretrain_gpt.py::test_context_parallel_trains_and_matches_cp1 trains
#: against CP1 by default (RoPE, GQA, the p2p ring on cpu, the same TE-spec attention)
EXTENDED = {
    "rope-gqa-cp2-p2p",
    "cp2-allgather",
    "cp2-p2p-flash-npu",
    "tp2-sp-cp2-p2p",
    "pp2-cp2-a2a",
    "dp2-cp2-allgather-distopt",
    "rope-gqa-cp2-a2a-flash-npu",
    "cp2-p2p",
    "cp2-a2a",
    "window-cp2-a2a-npu",
}


@pytest.fixture(scope="module")
def cp1(tmp_path_factory):
    """The one-rank run of each model, made once."""
    runs = {}

    def run(model: tuple[str, ...]):
        if model not in runs:
            folder = tmp_path_factory.mktemp("cp1")
            runs[model] = train(folder, *TINY, *COMMON, *model, name="cp1")
        return runs[model]

    return run


@pytest.mark.parametrize(
    "name",
    with_extended(sorted(LAYOUTS), EXTENDED),
)
def test_context_parallel_layout_matches_cp1(tmp_path, cp1, name):
    ranks, model, options = LAYOUTS[name]
    base = cp1(model)
    run = train(tmp_path, *TINY, *COMMON, *model, *options, nproc=ranks, name=name)
    cp = options[options.index("--context-parallel-size") + 1]
    assert f" x CP {cp} (" in run.stdout  # the layout line names the context-parallel size
    assert sorted(run.losses) == sorted(base.losses) == list(range(1, STEPS + 1))
    worst = max(abs(run.losses[s] - base.losses[s]) for s in base.losses)
    print(f"\n{name}: max |loss - CP1| over {STEPS} steps = {worst:.3e}")
    assert worst <= TOLERANCE, (base.losses, run.losses)
    assert base.losses[STEPS] < base.losses[1]  # it learns
    if model == WINDOW:  # the window narrows the attention: another model than the full one
        assert base.losses[1] != cp1(()).losses[1], base.losses
