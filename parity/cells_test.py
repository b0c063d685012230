"""Generated parity tests: one per (patch, dtype, parallel size, device) of the registry.

Each writes its JSON record into the results directory (``--parity-results``) and fails on an
``error`` verdict; ``warning`` is recorded and shown but does not fail (msprobe's meaning). A
cell that crashes or hangs still writes a record (an ``error`` with rule ``crash`` /
``timeout``, see :func:`parity.harness.evaluate`), so the summary counts it.
Collected by ``tests/parity/test_parity_matrix.py`` in CI and run directly by
``megatron-npu parity``.
"""

from __future__ import annotations

from parity.harness import Job, evaluate
from parity.matrix import Cell, case_examples, cells
from parity.metrics import dtype_name
from parity.results import write_record


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
            pool = rank_pools.get(cell.parallel.world)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot start fails this cell
            pool = _Unstartable(exc)
    record = evaluate(job, pool=pool)
    write_record(record, parity_results)
    failing = {n: t.verdict.reason for n, t in record.tensors.items() if t.verdict.status == "error"}
    if record.verdict.status == "error" and not failing:
        failing = {"cell": record.verdict.reason}
    assert not failing, f"{cell.id}: {failing}"


class _Unstartable:
    """Stands in for a rank pool that failed to start: every submit raises its error."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def submit(self, job):
        raise self.exc
