"""Evaluating one (patch, dtype, parallel size, device) combination into a ParityRecord.

:func:`run_examples` is what runs on every rank: it applies the adaptor for the device, runs the
patched path in the tested dtype and, on rank 0, the reference in the upcast dtype, and returns
comparisons. :func:`evaluate` drives it in this process (world size 1) or through a
:class:`parity.ranks.RankPool` (real gloo process groups) and turns the worst comparison of each
compared tensor across the examples into a record.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

import megatron_npu
from megatron_npu import devices, patcher
from megatron_npu.registry import Patch, get_patch
from parity.case import Context, Parallel, ParityCase, load_case, upcast
from parity.metrics import TensorComparison, compare, dtype_name
from parity.results import ParityRecord, collect_provenance
from parity.verdict import verdict


@dataclass(frozen=True)
class Job:
    """One unit of parity work, picklable so it can travel to worker ranks."""

    patch_id: str
    device: str
    dtype: str
    parallel: Parallel
    examples: tuple[dict[str, Any], ...]
    #: a planted bug (a name in :data:`parity.mutations.MUTATIONS`), active around ``case.run``
    #: only, on every rank; None for real runs. Used by tests/parity/test_mutations.py.
    mutation: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def _case_of(patch: Patch) -> ParityCase:
    if not patch.parity:
        raise LookupError(f"patch {patch.id!r} has no parity case ({patch.parity_exempt})")
    return load_case(patch.parity)


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _severity(comp: TensorComparison, tolerance: Any) -> tuple[int, float]:
    v = verdict(comp, tolerance)
    cosine = comp.cosine if comp.cosine is not None else 1.0
    return v.severity, -cosine


def _planted(mutation: str | None) -> Any:
    if mutation is None:
        return contextlib.nullcontext()
    from parity.mutations import planted

    return planted(mutation)


def run_examples(job: Job) -> dict[str, TensorComparison] | None:
    """Run ``job`` on this rank; rank 0 returns the worst comparison per compared tensor."""
    patch = get_patch(job.patch_id)
    case = _case_of(patch)
    megatron_npu.apply(job.device)
    rank, _ = _rank_and_world()
    device = devices.current_torch_device()
    original = patcher.original(patch)
    tested = job.torch_dtype
    tolerance = case.tolerance_for(tested)
    worst: dict[str, TensorComparison] = {}
    for params in job.examples:
        inputs = case.make_inputs(params)
        with _planted(job.mutation):
            got = case.run(
                Context(params, tested, tested, device, original, job.parallel, rank), inputs
            )
        if rank != 0:
            continue
        ref_ctx = Context(
            params, upcast(tested), tested, torch.device("cpu"), original, job.parallel, rank
        )
        want = case.reference(ref_ctx, inputs)
        if set(got) != set(want):
            raise AssertionError(
                f"{case.name}: run returned {sorted(got)} but reference returned {sorted(want)}"
            )
        for name in sorted(got):
            comp = compare(got[name].detach().cpu(), want[name].detach().cpu(), tested)
            if name not in worst or _severity(comp, tolerance) > _severity(worst[name], tolerance):
                worst[name] = comp
    return worst if rank == 0 else None


def evaluate(job: Job, pool: Any = None, seed: int = 0) -> ParityRecord:
    """Run ``job`` (in-process when world size is 1, else on ``pool``) and build its record."""
    patch = get_patch(job.patch_id)
    case = _case_of(patch)
    start = time.perf_counter()
    if job.parallel.world == 1:
        comparisons = run_examples(job)
    else:
        if pool is None:
            raise ValueError(f"{job.patch_id}: parallel size {job.parallel} needs a rank pool")
        comparisons = pool.submit(job)
    assert comparisons is not None
    provenance = collect_provenance(job.device, seed=seed, wall_time_s=time.perf_counter() - start)
    return ParityRecord.build(
        patch_id=patch.id,
        target=patch.target,
        case=case.name,
        dtype=dtype_name(job.torch_dtype),
        parallel=job.parallel.as_dict(),
        comparisons=comparisons,
        provenance=provenance,
        tolerance=case.tolerance_for(job.torch_dtype),
    )
