"""Context-parallel attention (``megatron_npu.ops.context_parallel``) on real gloo groups.

Each comm type, causal and full, grouped-query heads (and, for a2a, fewer key/value heads than
ranks), sliding windows where served, fp32 and bf16, on ``cpu`` (native blocks) and
``npu-emulated`` (``npu_fusion_attention`` blocks, ``npu_ring_attention_update``,
``npu_fusion_attention_grad``), forward and backward against float64 softmax attention over the
whole sequence. fp32 must agree to 1e-5; bf16 may be no further from the reference than twice
the device's single-device fused attention on the same inputs (plus 1e-3). With dropout, the
ring's backward is checked against a central difference of the forward that ran, and fp16 and
bf16 runs against fp32 runs that draw the same masks.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import tempfile

import pytest
import torch

from megatron_npu.context_parallel_options import comm_types_of, context_parallel_problems
from megatron_npu.ops.context_parallel import (
    ContextParallelError,
    chunk_order,
    context_parallel_attention,
    to_natural,
    to_rank_order,
)
from megatron_npu.ops.ring_attention import ring_steps

from . import _context_parallel_ranks as ranks

pytestmark = [pytest.mark.multiprocess]

DEVICES = ("cpu", "npu-emulated")

CASES = [
    {"comm": "p2p", "causal": True, "dtype": "float32"},
    {"comm": "p2p", "causal": False, "dtype": "float32"},
    {"comm": "p2p", "causal": True, "dtype": "bfloat16"},
    {"comm": "a2a", "causal": True, "dtype": "float32"},
    {"comm": "a2a", "causal": False, "dtype": "float32", "kv_heads": 1},  # heads shared out
    {"comm": "a2a", "causal": True, "dtype": "float32", "window": 5},
    {"comm": "a2a", "causal": True, "dtype": "bfloat16"},
    {"comm": "allgather", "causal": True, "dtype": "float32"},
    {"comm": "allgather", "causal": False, "dtype": "float32"},
    {"comm": "allgather", "causal": True, "dtype": "float32", "window": 5},
    {"comm": "allgather", "causal": True, "dtype": "bfloat16", "kv_heads": 4},
]
#: the difference quotient is exact to ~1e-9 in float64 (native blocks); the emulated kernels
#: take fp32 only, where it is good to about 1 % (a wrong dropout mask is off by ~100 %)
DROPOUT = [
    {
        "comm": "p2p",
        "causal": True,
        "dtype": "float64",
        "eps": 1e-4,
        "rel": 1e-6,
        "devices": ("cpu",),
    },
    {
        "comm": "p2p",
        "causal": False,
        "dtype": "float64",
        "eps": 1e-4,
        "rel": 1e-6,
        "devices": ("cpu",),
    },
    {
        "comm": "p2p",
        "causal": True,
        "dtype": "float32",
        "eps": 3e-3,
        "rel": 3e-2,
        "devices": ("npu-emulated",),
    },
]


#: 16-bit runs with attention dropout against fp32 runs that draw the same masks (both devices:
#: the native ring blocks and the NPU path's fused-attention kernels)
HALF_DROPOUT = [
    {"comm": "p2p", "causal": True, "dtype": "float16"},
    {"comm": "p2p", "causal": False, "dtype": "float16"},
    {"comm": "a2a", "causal": True, "dtype": "float16"},
    {"comm": "p2p", "causal": True, "dtype": "bfloat16"},
]


def _case_id(case: dict) -> str:
    return "-".join(str(v) for k, v in case.items() if k != "devices")


def run_ranks(world: int, device: str, jobs: list, timeout_s: float = 240.0) -> list[list]:
    """``jobs`` on ``world`` spawned gloo ranks; per job, each rank's outcome."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="cp-store-"), "store")
    procs = [
        ctx.Process(target=ranks.worker, args=(r, world, store, device, jobs, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcomes = [[None] * world for _ in jobs]
    try:
        for _ in range(world * len(jobs)):
            rank, index, outcome = results.get(timeout=timeout_s)
            outcomes[index][rank] = outcome
    except queue.Empty:
        pytest.fail(f"context-parallel ranks on {device} did not answer in {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return outcomes


@functools.cache
def _cp2(device: str) -> dict:
    """Every CP2 job of ``device`` on one pair of spawned ranks (started once per device)."""
    jobs = (
        [("case", c) for c in CASES]
        + [("dropout", c) for c in DROPOUT if device in c["devices"]]
        + [("dropout16", c) for c in HALF_DROPOUT]
    )
    return {
        _job_id(kind, case): outcome
        for (kind, case), outcome in zip(jobs, run_ranks(2, device, jobs), strict=True)
    }


def _job_id(kind: str, case: dict) -> str:
    return f"{kind}-{_case_id(case)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cp2_attention_matches_whole_sequence_attention(device, case):
    for rank, outcome in enumerate(_cp2(device)[_job_id("case", case)]):
        assert "raised" not in outcome, outcome["raised"]
        errors = outcome["errors"]
        if case["dtype"] == "float32":
            assert max(errors) <= 1e-5, (device, rank, errors)
        else:
            bound = [2 * e + 1e-3 for e in outcome["single"]]
            assert all(e <= b for e, b in zip(errors, bound, strict=True)), (
                device,
                rank,
                errors,
                bound,
            )


@pytest.mark.parametrize("device", DEVICES)
def test_the_ring_calls_one_kernel_per_block_on_the_npu_path(device):
    """p2p on CP2: on the npu path two forward blocks merged by one update and two gradient
    blocks per rank; the cpu path calls no kernel at all."""
    for outcome in _cp2(device)[_job_id("case", CASES[0])]:  # p2p causal fp32
        kernels = outcome["kernels"]
        if device == "cpu":
            assert kernels == {}, kernels
            continue
        assert kernels["npu_fusion_attention"] == 2, kernels
        assert kernels["npu_ring_attention_update"] == 1, kernels
        assert kernels["npu_fusion_attention_grad"] == 2, kernels


@pytest.mark.parametrize(
    ("device", "case"),
    [(d, c) for c in DROPOUT for d in c["devices"]],
    ids=[f"{d}-{_case_id(c)}" for c in DROPOUT for d in c["devices"]],
)
def test_ring_dropout_backward_is_the_derivative_of_its_forward(device, case):
    for outcome in _cp2(device)[_job_id("dropout", case)]:
        assert "raised" not in outcome, outcome["raised"]
        assert outcome["repeatable"] and outcome["dropped"] > 1e-2, outcome
        assert outcome["analytic"] == pytest.approx(outcome["numeric"], rel=case["rel"]), outcome


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", HALF_DROPOUT, ids=_case_id)
def test_16_bit_dropout_drops_what_fp32_drops(device, case):
    """With dropout 0.3, the 16-bit output and gradients are no further from an fp32 run that
    draws the same masks than twice their distance without dropout (plus 1e-3)."""
    for rank, outcome in enumerate(_cp2(device)[_job_id("dropout16", case)]):
        assert "raised" not in outcome, outcome["raised"]
        print(
            f"\n{device} rank {rank}: 16-bit vs fp32 with dropout {outcome['errors']}, "
            f"without {outcome['yardstick']}"
        )
        assert outcome["dropped"] > 1e-2, outcome  # the dropout changed the output
        bound = [2 * e + 1e-3 for e in outcome["yardstick"]]
        assert all(e <= b for e, b in zip(outcome["errors"], bound, strict=True)), (
            device,
            rank,
            outcome,
        )


def test_cp4_ring_matches_whole_sequence_attention():
    """Four ranks: every ring step kind (own block, lower and higher ranks' blocks) on each;
    and hierarchical a2a+p2p (an all-to-all within pairs of ranks, a ring over the pairs),
    causal and full, with GQA whose key/value heads the all-to-all does and does not divide."""
    hierarchical = {"comm": "a2a+p2p", "sizes": (2, 2), "dtype": "float32"}
    jobs = [
        ("case", {"comm": "p2p", "causal": True, "dtype": "float32"}),
        ("case", {"comm": "a2a", "causal": True, "dtype": "float32", "heads": 8}),
        ("case", {**hierarchical, "causal": True}),
        ("case", {**hierarchical, "causal": False, "heads": 4, "kv_heads": 1, "seed": 3}),
    ]
    for index, per_rank in enumerate(run_ranks(4, "cpu", jobs)):
        for rank, outcome in enumerate(per_rank):
            assert "raised" not in outcome, outcome["raised"]
            assert max(outcome["errors"]) <= 1e-5, (index, rank, outcome["errors"])


def test_cp4_hierarchical_on_the_npu_path():
    """a2a+p2p on npu-emulated: the ring's blocks are the fused-attention kernels (bf16,
    within twice the device's own single-device error), merged by the ring-update kernel."""
    case = {"comm": "a2a+p2p", "sizes": (2, 2), "dtype": "bfloat16", "causal": True}
    for rank, outcome in enumerate(run_ranks(4, "npu-emulated", [("case", case)])[0]):
        assert "raised" not in outcome, outcome["raised"]
        bound = [2 * e + 1e-3 for e in outcome["single"]]
        assert all(e <= b for e, b in zip(outcome["errors"], bound, strict=True)), (rank, outcome)
        assert outcome["kernels"]["npu_ring_attention_update"] >= 1, outcome["kernels"]


# --------------------------------------------------------------- single-process behaviour


def test_ring_steps_cover_each_causal_pair_once():
    """Over the ring, every (query, key) pair with key <= query is computed exactly once."""
    cp, local = 3, 4
    half = local // 2
    for rank in range(cp):
        seen = torch.zeros(2 * cp * half, 2 * cp * half, dtype=torch.int64)
        q_pos = torch.tensor(
            [p for c in (rank, 2 * cp - 1 - rank) for p in range(c * half, (c + 1) * half)]
        )
        for i, step in enumerate(ring_steps(rank, cp, local, causal=True)):
            src = (rank - i) % cp
            k_pos = torch.tensor(
                [p for c in (src, 2 * cp - 1 - src) for p in range(c * half, (c + 1) * half)]
            )
            for qi in q_pos[step.q_rows]:
                for ki in k_pos[step.kv_rows]:
                    if not step.causal or ki <= qi:
                        seen[qi, ki] += 1
        for qi in q_pos:
            assert seen[qi, : qi + 1].tolist() == [1] * (int(qi) + 1)
            assert int(seen[qi, qi + 1 :].sum()) == 0


def test_natural_order_round_trips():
    x = torch.arange(16)
    assert chunk_order(2) == [0, 3, 1, 2]
    assert to_natural(to_rank_order(x, 2), 2).tolist() == x.tolist()
    assert to_rank_order(x, 2).view(4, 4)[1].tolist() == [12, 13, 14, 15]


@pytest.mark.parametrize(
    "comm, rows, match",
    [
        ("a2a+p2p", 4, "pair of hierarchical context-parallel groups"),
        ("ring", 4, "unknown --cp-comm-type"),
        ("p2p", 3, "even count"),
    ],
)
def test_bad_calls_are_named_errors(comm, rows, match):
    q = torch.randn(rows, 1, 2, 4)
    with pytest.raises(ContextParallelError, match=match):
        context_parallel_attention(q, q, q, None, comm_type=comm, causal=True)


def test_option_problems_name_each_option():
    problems = context_parallel_problems(
        cp=2,
        comm_types=comm_types_of(["p2p", "a2a", "a2a+p2p"]),
        transformer_impl="local",
        seq_length=30,
        heads=6,
        tp=2,
        window="--window-size",
    )
    text = "; ".join(problems)
    for expected in (
        "--transformer-impl local",
        "--seq-length 30",
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
        "--cp-comm-type a2a: the 3 attention heads",
        "--cp-comm-type p2p with --window-size",
    ):
        assert expected in text, text
    assert (
        context_parallel_problems(
            cp=1,
            comm_types=["x"],
            transformer_impl="local",
            seq_length=3,
            heads=1,
            tp=1,
            window="--window-size",
        )
        == []
    )
    assert (
        context_parallel_problems(
            cp=2,
            comm_types=["p2p"],
            transformer_impl="transformer_engine",
            seq_length=64,
            heads=4,
            tp=1,
            window=None,
        )
        == []
    )
