"""One benchmark per registry patch that declares one, every path x dtype x direction.

Generated from :func:`megatron_npu.registry.all_patches`: a patch's ``benchmark`` names its
:class:`perf.case.BenchCase`; patches for other megatron-core releases than the installed one
have no cells (their target may not exist here). ``pytest perf --benchmark-only`` runs the sizes
that matter; ``--perf-quick`` the smoke sizes.
"""

from __future__ import annotations

import pytest

from megatron_npu.patcher import megatron_core_version
from megatron_npu.registry import all_patches
from perf.case import SIZES, load_benchmark
from perf.runner import run_cell

_BENCHMARKED = [
    p for p in all_patches() if p.benchmark and p.applies_to_version(megatron_core_version())
]


def _cells():
    for patch in _BENCHMARKED:
        case = load_benchmark(patch.benchmark)
        for index, _ in enumerate(case.cells(patch.id, SIZES[0])):
            yield pytest.param(patch.id, index, id=case.cells(patch.id, SIZES[0])[index].id())


@pytest.mark.parametrize(("patch_id", "index"), list(_cells()))
def test_patched_op(benchmark, patch_id, index, perf_size, gloo_world_of_one):
    patch = next(p for p in _BENCHMARKED if p.id == patch_id)
    case = load_benchmark(patch.benchmark)
    cell = case.cells(patch.id, perf_size)[index]
    run_cell(benchmark, cell, case.build, case.rounds, size=perf_size, **case.extra)
