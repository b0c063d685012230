"""Mutation test of the parity harness: every planted bug (parity/mutations.py) turns its
patch's parity job into an ``error``, and the same job without the bug is not an error (so each
check can fail). The TP2 mutations are planted inside the rank-pool workers."""

from __future__ import annotations

import importlib

import pytest

from parity.harness import evaluate
from parity.mutations import MUTATIONS, planted


def _evaluate(mutation, with_bug, rank_pools):
    job = mutation.job(with_bug=with_bug)
    pool = rank_pools.get(job.parallel.world) if job.parallel.world > 1 else None
    return evaluate(job, pool=pool)


def _why(record):
    return {name: t.verdict.reason for name, t in record.tensors.items()}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_planted_bug_is_an_error(name, rank_pools):
    mutation = MUTATIONS[name]
    clean = _evaluate(mutation, False, rank_pools)
    assert clean.verdict.status != "error", f"{name}: fails without the bug: {_why(clean)}"
    caught = _evaluate(mutation, True, rank_pools)
    assert caught.verdict.status == "error", f"{name}: not caught: {_why(caught)}"


def test_there_are_enough_mutations():
    assert len(MUTATIONS) >= 8
    assert any(m.parallel.world > 1 for m in MUTATIONS.values())


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_planting_restores_the_target(name):
    mutation = MUTATIONS[name]
    module_name, _, attr = mutation.target.rpartition(".")
    module = importlib.import_module(module_name)
    before = getattr(module, attr)
    with planted(name):
        assert getattr(module, attr) is not before
    assert getattr(module, attr) is before


def test_unknown_mutation_is_named():
    with pytest.raises(KeyError, match="no mutation 'nope'"):
        with planted("nope"):
            pass
