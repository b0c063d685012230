"""Every registry patch has a benchmark case, or a written exemption (pure plumbing).

Mirrors the parity coverage gate: the generated suite in ``perf/`` times exactly the cases
named here, so a patch added without one fails this test instead of going unmeasured.
"""

from __future__ import annotations

import pytest

from megatron_npu.registry import Patch, all_patches
from perf.case import PATHS, SIZES, BenchCase, load_benchmark


def _gaps(patches: list[Patch]) -> list[str]:
    return [p.id for p in patches if not p.benchmark and not p.benchmark_exempt.strip()]


def test_every_patch_has_a_benchmark_or_a_written_exemption():
    missing = _gaps(all_patches())
    assert not missing, f"patches without a benchmark or benchmark_exempt reason: {missing}"


def test_the_gate_catches_a_patch_without_one():
    bare = Patch(
        id="demo.no-benchmark",
        target="megatron.core.demo.fn",
        replacement=len,
        reason="demo",
        parity="megatron_npu.parity.cases.demo:DEMO",
    )
    exempt = Patch(
        id="demo.exempt",
        target="megatron.core.demo.fn",
        replacement=len,
        reason="demo",
        parity="megatron_npu.parity.cases.demo:DEMO",
        benchmark_exempt="plumbing",
    )
    assert _gaps([bare, exempt]) == ["demo.no-benchmark"]


def test_no_patch_is_both_benchmarked_and_exempt():
    both = [p.id for p in all_patches() if p.benchmark and p.benchmark_exempt]
    assert not both, both


@pytest.mark.parametrize("patch", [p for p in all_patches() if p.benchmark], ids=lambda p: p.id)
def test_benchmark_references_resolve_and_expand(patch):
    case = load_benchmark(patch.benchmark)
    assert isinstance(case, BenchCase)
    for size in SIZES:
        cells = case.cells(patch.id, size)
        assert cells and {c.path for c in cells} <= set(PATHS)
        assert all(c.patch_id == patch.id and c.op == case.op for c in cells)
        # the emulated binding is labelled as such, never as a device of its own
        assert all(c.emulated == (c.path == "npu-binding") for c in cells)
        assert all(c.device == ("npu-emulated" if c.emulated else "cpu") for c in cells)


def test_bad_benchmark_reference_names_the_problem():
    with pytest.raises(ValueError, match="is not 'module:NAME'"):
        load_benchmark("perf.cases.attention")
    with pytest.raises(LookupError, match="does not name a BenchCase"):
        load_benchmark("perf.cases.attention:build")
