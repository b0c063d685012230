"""Mutation test of the parity harness: every planted bug (parity/mutations.py) turns its
patch's parity job into an ``error``, and the same job without the bug is not an error (so each
check can fail). The TP2 mutations are planted inside the rank-pool workers."""

from __future__ import annotations

import importlib

import pytest
from megatron_npu.parity.harness import evaluate_mutation
from megatron_npu.parity.mutations import MUTATIONS, planted

from megatron_npu.devices.facts import NPU_EMULATED
from megatron_npu.patcher import megatron_core_version
from megatron_npu.registry import all_patches, get_patch

#: the mutations of patches that apply to the installed megatron-core (tox runs each release's)
HERE = sorted(
    name
    for name, m in MUTATIONS.items()
    if get_patch(m.patch_id).applies_to_version(megatron_core_version())
)


def _evaluate(mutation, with_bug, rank_pools):
    world = mutation.parallel.world
    pool = rank_pools.get(world, mutation.device) if world > 1 else None
    return evaluate_mutation(mutation, with_bug, pool=pool)


def _why(record):
    return {name: t.verdict.reason for name, t in record.tensors.items()}


@pytest.mark.parametrize("name", HERE)
def test_planted_bug_is_an_error(name, rank_pools):
    mutation = MUTATIONS[name]
    clean = _evaluate(mutation, False, rank_pools)
    assert clean.verdict.status != "error", f"{name}: fails without the bug: {_why(clean)}"
    caught = _evaluate(mutation, True, rank_pools)
    assert caught.verdict.status == "error", f"{name}: not caught: {_why(caught)}"
    # caught by a rule, not by the planted code crashing (which would test no verdict)
    assert caught.verdict.rule != "crash", f"{name}: the planted code crashed: {caught.verdict}"


def test_there_are_enough_mutations_in_every_patched_area():
    assert len(MUTATIONS) >= 25
    mutations = MUTATIONS.values()
    assert any(m.parallel.world > 1 for m in mutations)  # under TP2
    assert any(m.dtype == "bfloat16" for m in mutations)  # a one-dtype bug
    assert any(m.device == NPU_EMULATED for m in mutations)  # in the NPU binding / kernel
    assert any(m.examples[0].get("dropout", 0) > 0 for m in mutations)
    assert any(m.scope == "job" for m in mutations)  # a reference that calls the implementation
    # a window narrower than the sequence, with several query blocks
    assert any(
        e.get("pre", 1 << 30) + 64 < e.get("kv_seq", 0) for m in mutations for e in m.examples
    )
    # every area with numerics (the device-routing torch-namespace entries have none of their
    # own: their cases check collectives end to end)
    areas = {p.id.split(".")[0] for p in all_patches() if p.parity and ":" not in p.id}
    planted_areas = {m.patch_id.split(".")[0] for m in mutations}
    assert areas <= planted_areas, f"patched areas without a planted bug: {areas - planted_areas}"


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


def test_a_bug_only_in_16_bit_accumulation_needs_the_16_bit_cells():
    """The grad-norm kernel's 16-bit-only bug leaves every fp32 cell passing, so only cells that
    draw 16-bit grads can catch it: the grad-norm case draws fp16 and bf16 on every device."""
    import dataclasses

    import torch
    from megatron_npu.parity.cases.optimizer import GRAD_NORM

    for name in ("grad-norm-16bit-accumulation", "grad-norm-bf16-accumulation"):
        as_fp32 = dataclasses.replace(MUTATIONS[name], dtype="float32")
        record = evaluate_mutation(as_fp32, True)
        assert record.verdict.status != "error", f"{name} is not 16-bit only: {_why(record)}"
    for device, dtypes in GRAD_NORM.dtypes.items():
        assert {torch.float16, torch.bfloat16} <= set(dtypes), device
