"""The rank pool: a failing rank surfaces with its traceback, a hanging rank is named, and in
both cases every worker process is gone before the call returns."""

from __future__ import annotations

import pytest

from parity.case import Parallel
from parity.harness import Job
from parity.ranks import RankError, RankPool, RankTimeout

JOB = Job("any", "cpu", "float32", Parallel(tp=2), ())


def _workers(pool):
    return list(pool._procs)


def test_failing_rank_surfaces_with_its_traceback_and_no_process_survives():
    pool = RankPool(2, timeout_s=60, runner="parity._selftest:fail_on_rank_1")
    procs = _workers(pool)
    with pytest.raises(RankError) as err:
        pool.submit(JOB)
    text = str(err.value)
    assert "--- rank 1 ---" in text and "deliberate failure on rank 1" in text
    assert "Traceback" in text
    assert not any(p.is_alive() for p in procs)
    assert not pool.alive


def test_hanging_rank_is_named_and_killed():
    pool = RankPool(2, timeout_s=8, runner="parity._selftest:hang_on_rank_1")
    procs = _workers(pool)
    with pytest.raises(RankTimeout, match=r"ranks \[1\] gave no answer within 8s"):
        pool.submit(JOB)
    assert not any(p.is_alive() for p in procs)


def test_a_crashing_rank_pool_cell_is_an_error_record():
    from megatron_npu.registry import get_patch
    from parity.harness import evaluate

    patch = get_patch("cross-entropy.vocab-parallel")
    job = Job(patch.id, "cpu", "float32", Parallel(tp=2), ())
    pool = RankPool(2, timeout_s=60, runner="parity._selftest:fail_on_rank_1")
    record = evaluate(job, pool=pool)
    assert (record.verdict.status, record.verdict.rule) == ("error", "crash")
    assert "deliberate failure on rank 1" in record.verdict.reason
    assert record.tensors == {} and not pool.alive
