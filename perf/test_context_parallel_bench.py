"""Context parallelism's point is memory: one training step of a long sequence, CP1 against CP2.

A 2-layer GPT of Megatron's TE spec (hidden 256, 4 heads, vocab 1024, no dropout, flash
attention: the fused op at CP1, the ring's fused blocks at CP2) trains one
step on one sequence of 8192 tokens (``--perf-quick``: 1024) on ``cpu``: CP1 on one rank, CP2 on
two gloo ranks with the ring (``p2p``), Megatron's own ``get_batch_on_this_cp_rank`` splitting the
sequence (``perf/_context_parallel_ranks.py``). Each cell records, per rank, the peak bytes torch
allocated during one step (``peak_memory_bytes``: the largest rank's) and the median step time
of three (``step_s``; the benchmark's own timing includes starting the ranks). The CP2 cell
holds the target: its peak per rank is at most 0.6 x CP1's (``peak_memory_vs_cp1``). Times on this
shared-core host are for like-for-like reading only (CP2's two ranks share the two cores CP1 has to
itself).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import tempfile

import pytest

from perf import _context_parallel_ranks as ranks

SHAPES = {
    "full": {"seq": 8192, "hidden": 256, "heads": 4, "layers": 2},
    "quick": {"seq": 1024, "hidden": 256, "heads": 4, "layers": 2},
}
#: CP2's peak allocated memory per rank over CP1's, at most (the issue's target)
MEMORY_TARGET = 0.6
STEPS = 3


@functools.cache
def _measure(cp: int, size: str) -> list[dict]:
    """Per rank: ``peak_bytes`` and ``step_s`` of one step at ``size`` on ``cp`` ranks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="cp-bench-"), "store")
    procs = [
        ctx.Process(target=ranks.worker, args=(r, cp, store, SHAPES[size], STEPS, results))
        for r in range(cp)
    ]
    for p in procs:
        p.start()
    per_rank: list[dict] = [{} for _ in range(cp)]
    try:
        for _ in range(cp):
            rank, outcome = results.get(timeout=1800)
            per_rank[rank] = outcome
    except queue.Empty:
        pytest.fail(f"the CP{cp} step did not finish")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return per_rank


@pytest.mark.parametrize("cp", [1, 2])
def test_context_parallel_step(benchmark, perf_size, cp):
    per_rank = benchmark.pedantic(lambda: _measure(cp, perf_size), rounds=1, iterations=1)
    shape = SHAPES[perf_size]
    benchmark.group = "context-parallel-step"
    benchmark.extra_info.update(
        patch_id="transformer-engine.context-parallel-attention",
        op="context-parallel-step",
        path=f"cp{cp}",
        device="cpu",
        emulated=False,
        dtype="float32",
        direction="step",
        shape=",".join(f"{k}={v}" for k, v in shape.items()),
        peak_memory_bytes=max(r["peak_bytes"] for r in per_rank),
        peak_memory_bytes_per_rank=[r["peak_bytes"] for r in per_rank],
        step_s=max(r["step_s"] for r in per_rank),
        torch_threads=1,
    )
    if cp > 1:  # the target: CP2's peak per rank at most 0.6 x CP1's
        single = max(r["peak_bytes"] for r in _measure(1, perf_size))
        ratio = benchmark.extra_info["peak_memory_bytes"] / single
        benchmark.extra_info["peak_memory_vs_cp1"] = ratio
        print(
            f"peak per rank: CP1 {single / 2**20:.1f} MiB, CP{cp} "
            f"{benchmark.extra_info['peak_memory_bytes'] / 2**20:.1f} MiB ({ratio:.3f} x)"
        )
        assert ratio <= MEMORY_TARGET, (single, per_rank)
