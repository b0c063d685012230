"""Generated parity tests: one per (patch, dtype, parallel size, device) of the registry.

Each writes its JSON record into the results directory (``--parity-results``) and fails on an
``error`` verdict; ``warning`` is recorded and shown but does not fail (msprobe's meaning). A
cell that crashes or hangs still writes a record (an ``error`` with rule ``crash`` /
``timeout``, see :func:`megatron_npu.parity.harness.evaluate`), so the summary counts it.
Collected by ``tests/parity/test_parity_matrix.py`` in CI and run directly by
``megatron-npu parity``.
"""

from __future__ import annotations

from megatron_npu.parity.harness import SIXTEEN_BIT, Job, evaluate
from megatron_npu.parity.matrix import Cell, case_examples, cells
from megatron_npu.parity.metrics import dtype_name
from megatron_npu.parity.results import write_record


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        devices = tuple(d for d in metafunc.config.getoption("parity_devices").split(",") if d)
        matrix = cells(devices)
        metafunc.parametrize("cell", matrix, ids=[c.id for c in matrix])


def test_parity(cell: Cell, parity_mode, parity_results, rank_pools):
    job = Job(
        patch_id=cell.patch.id,
        device=cell.device,
        dtype=dtype_name(cell.dtype),
        parallel=cell.parallel,
        examples=case_examples(cell.case.name, parity_mode),
    )
    pool = None
    if cell.parallel.world > 1:
        try:
            pool = rank_pools.get(cell.parallel.world, cell.device)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot start fails this cell
            pool = _Unstartable(exc)
    record = evaluate(job, pool=pool)
    write_record(record, parity_results)
    failing = {
        n: t.verdict.reason for n, t in record.tensors.items() if t.verdict.status == "error"
    }
    if record.verdict.status == "error" and not failing:
        failing = {"cell": record.verdict.reason}
    assert not failing, f"{cell.id}: {failing}"
    if cell.dtype in SIXTEEN_BIT:
        _assert_benchmarked(cell, record)


def _assert_benchmarked(cell: Cell, record) -> None:
    """A 16-bit cell passes or fails on msprobe's stage-2 benchmark: every float tensor has one
    (its worst example included), so no 16-bit cell falls back to stage 1's standing warning."""
    floats = {n for n, t in record.tensors.items() if t.metrics.kind == "float"}
    section = record.benchmark
    judged = set(section.tensors) if section is not None else set()
    unavailable = section.unavailable if section is not None else None
    assert unavailable is None and floats <= judged, (
        f"{cell.id}: 16-bit cell without a stage-2 benchmark for {sorted(floats - judged)}"
        f" ({unavailable or 'no benchmark section'})"
    )


class _Unstartable:
    """Stands in for a rank pool that failed to start: every submit raises its error."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def submit(self, job):
        raise self.exc
