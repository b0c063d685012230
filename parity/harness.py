"""Evaluating one (patch, dtype, parallel size, device) combination into a ParityRecord.

:func:`run_examples` is what runs on every rank: it applies the adaptor for the device, runs the
patched path in the tested dtype (counting the emulated NPU kernels it calls) and, on rank 0,
the reference in the upcast dtype and, as a benchmark, the same reference in the tested dtype:
always for fp16/bf16 (msprobe's stage-2 benchmark), for fp32 only when an output exceeds the
dtype's relative L2 floor (the benchmark then shows how ill-conditioned the output is). References
and benchmarks run under :func:`reference_environment`: on the CPU, with Megatron's ``"cuda"``
allocations routed to the CPU, torch's own products (:func:`torch_products`) and every site of the
patch under test replaced by a tripwire, so a reference that reaches the implementation is caught.

:func:`evaluate` drives it in this process (world size 1) or through a
:class:`megatron_npu.parity.ranks.RankPool` (real gloo process groups) and turns the worst outcome
of each compared tensor across the examples into a record. A cell that raises, hangs past its
deadline or whose reference touches the implementation still gives a record: an ``error`` with rule
``crash``, ``timeout`` or ``reference_hygiene`` and possibly no tensors.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from megatron_npu.parity.benchmark import BenchmarkResult, against_benchmark, level_of
from megatron_npu.parity.case import Context, Parallel, ParityCase, load_case, upcast
from megatron_npu.parity.metrics import TensorComparison, compare, dtype_name
from megatron_npu.parity.mutations import Mutation, planted
from megatron_npu.parity.provenance import collect_provenance
from megatron_npu.parity.results import ParityRecord, build_record, failed_record
from megatron_npu.parity.verdict import final_verdict

import megatron_npu
from megatron_npu import devices, patcher
from megatron_npu.devices.facts import CPU, FACTS
from megatron_npu.registry import Patch, get_patch
from megatron_npu.testing import torch_npu_emulation
from megatron_npu.testing.torch_npu_emulation import count_kernel_calls

#: Seconds an in-process cell may run before it is stopped and recorded as ``timeout``.
CELL_TIMEOUT_S = float(os.environ.get("MEGATRON_NPU_PARITY_TIMEOUT", "240"))
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Job:
    """One unit of parity work, picklable so it can travel to worker ranks."""

    patch_id: str
    device: str
    dtype: str
    parallel: Parallel
    examples: tuple[dict[str, Any], ...]
    #: a planted bug (a name in :data:`megatron_npu.parity.mutations.MUTATIONS`), active around
    #: ``case.run`` only, on every rank; None for real runs. Used by tests/parity/test_mutations.py.
    mutation: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class TensorOutcome:
    """The worst example of one compared tensor: stage 1 and (16-bit) stage 2."""

    comparison: TensorComparison
    benchmark: BenchmarkResult | None = None


@dataclass
class CellOutcome:
    """What rank 0 sends back for a job (picklable)."""

    tensors: dict[str, TensorOutcome] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)
    benchmark_unavailable: str | None = None  # why a 16-bit cell has no benchmark


class ReferenceHygieneError(AssertionError):
    """A case's reference (or benchmark) called or read the object the patch installed."""


class CellTimeout(TimeoutError):
    """An in-process cell ran past :data:`CELL_TIMEOUT_S`."""


def _case_of(patch: Patch) -> ParityCase:
    if not patch.parity:
        raise LookupError(f"patch {patch.id!r} has no parity case ({patch.parity_exempt})")
    return load_case(patch.parity)


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _planted(mutation: str | None) -> Any:
    if mutation is None:
        return contextlib.nullcontext()
    return planted(mutation)


# --------------------------------------------------------------------------- reference hygiene


def _tripwire(obj: Any, label: str, hits: list[str]) -> Any:
    """A stand-in for ``obj`` that records ``label`` in ``hits`` when called, built or read."""
    if isinstance(obj, (staticmethod, classmethod)):
        return type(obj)(_tripwire(obj.__func__, label, hits))
    if isinstance(obj, type):

        def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            hits.append(label)
            obj.__init__(self, *args, **kwargs)

        return type(obj.__name__, (obj,), {"__init__": __init__, "__module__": obj.__module__})
    if callable(obj):

        @functools.wraps(obj)
        def tripped(*args: Any, **kwargs: Any) -> Any:
            hits.append(label)
            return obj(*args, **kwargs)

        return tripped

    class Tripwire(ModuleType):  # a namespace (e.g. a module's routed ``torch``): any read
        def __getattr__(self, name: str) -> Any:
            hits.append(f"{label}.{name}")
            return getattr(obj, name)

    return Tripwire(getattr(obj, "__name__", label))


def installed_sites(patch: Patch) -> list[tuple[Any, str, Any]]:
    """``(owner, name, installed object)`` of every place ``patch`` is installed right now.

    Reads the patcher's record of sites (the target and every rebound ``from x import f``
    copy); empty when the patch is not applied.
    """
    try:
        owner, name = patcher.resolve(patch.target)
    except (ImportError, AttributeError):
        return []
    own_raw = _raw(owner, name)
    built = _unwrapped(own_raw)
    return [
        (site.owner, site.name, site.installed)
        for site in patcher._state.sites  # noqa: SLF001 - the patcher's own site list
        if _unwrapped(site.installed) is built
    ]


def _raw(owner: Any, name: str) -> Any:
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
    return getattr(owner, name)


def _unwrapped(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


@contextlib.contextmanager
def tripwires(patch: Patch) -> Iterator[list[str]]:
    """Replace every installed site of ``patch`` by a tripwire; yield the list of hits."""
    hits: list[str] = []
    sites = installed_sites(patch)
    for owner, name, installed in sites:
        setattr(owner, name, _tripwire(installed, f"{patch.id} ({patch.target})", hits))
    try:
        yield hits
    finally:
        for owner, name, installed in reversed(sites):
            setattr(owner, name, installed)


@contextlib.contextmanager
def cpu_routing() -> Iterator[None]:
    """Route the adaptor's device handling to the CPU and native ops for the block.

    Megatron code reached by a reference allocates on ``"cuda"`` (``get_default_causal_mask``,
    ``GlobalMemoryBuffer`` ...); the adaptor routes that to the active device. Here the CPU
    device is active instead, so such tensors land on the CPU whatever device is under test,
    and the op layer calls no NPU kernel. The previous device is put back afterwards.
    """
    from megatron_npu.ops.kernels import npu_kernels, use_npu_kernels

    before, kernels = devices.active(), npu_kernels()
    devices.activate(devices.make(CPU))
    try:
        yield
    finally:
        if before is None:
            devices.deactivate()
        else:
            devices.activate(before)
        use_npu_kernels(kernels)


@contextlib.contextmanager
def fresh_memory_buffer() -> Iterator[None]:
    """A new, empty Megatron ``GlobalMemoryBuffer`` for the block (when parallel state has one).

    The buffer keeps the tensors it hands out: without this a reference would reuse the one
    the tested run allocated on the device under test (``DotProductAttention`` takes its
    ``baddbmm`` input from it).
    """
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    before = parallel_state._GLOBAL_MEMORY_BUFFER  # noqa: SLF001 - Megatron's module global
    if before is not None:
        parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()  # noqa: SLF001
    try:
        yield
    finally:
        if before is not None:
            parallel_state._GLOBAL_MEMORY_BUFFER = before  # noqa: SLF001


@functools.cache
def _torch_wrappers() -> tuple[Patch, ...]:
    """The registry's patches that wrap a torch name with code of their own (a parity case)."""
    from megatron_npu.registry import all_patches

    return tuple(p for p in all_patches() if p.target.startswith("torch.") and p.parity)


@contextlib.contextmanager
def torch_products() -> Iterator[None]:
    """torch's own functions for the block, where the registry wraps a torch name with code of
    its own (the ``matmul.*`` patches: 16-bit products computed in fp32 on the CPU stand-ins):
    a reference multiplies with torch's products, not the adaptor's. Plumbing that only lets
    Megatron's code run on the device (``Tensor.cuda``, ``Tensor.type``) stays. Whatever each
    site held is put back afterwards (a tripwire included)."""
    swapped = []
    for wrapped in _torch_wrappers():
        for owner, name, _ in installed_sites(wrapped):
            swapped.append((owner, name, _raw(owner, name)))
            setattr(owner, name, patcher.original(wrapped))
    try:
        yield
    finally:
        for owner, name, held in reversed(swapped):
            setattr(owner, name, held)


@contextlib.contextmanager
def reference_environment(patch: Patch) -> Iterator[list[str]]:
    """CPU routing, a fresh memory buffer, tripwires on ``patch`` and torch's own products;
    yields the tripwire hits."""
    with cpu_routing(), fresh_memory_buffer(), tripwires(patch) as hits, torch_products():
        yield hits


def _check_clean(hits: list[str], case: ParityCase, what: str) -> None:
    if hits:
        raise ReferenceHygieneError(
            f"{case.name}: the {what} reached the implementation under test: "
            f"{sorted(set(hits))} ({len(hits)} calls); a reference must use ctx.original or "
            "independent maths"
        )


def _off_cpu(outputs: dict[str, torch.Tensor], case: ParityCase, what: str) -> None:
    wrong = {n: str(t.device) for n, t in outputs.items() if t.device.type != "cpu"}
    if wrong:
        raise ReferenceHygieneError(f"{case.name}: the {what} left the CPU: {wrong}")


# --------------------------------------------------------------------------- running a job


@contextlib.contextmanager
def kernel_calls() -> Iterator[Counter]:
    """Count the NPU kernels the op layer calls in the block, by torch_npu name.

    The emulation counts its own calls (:func:`count_kernel_calls`); a real torch_npu module
    (an ``npu`` cell) gets counting wrappers on the same kernel names for the block, since the
    op layer looks its kernels up on the module at call time.
    """
    from megatron_npu.ops.kernels import npu_kernels

    module = npu_kernels()
    if module is None or module is torch_npu_emulation:
        with count_kernel_calls() as counter:
            yield counter
        return
    counter: Counter = Counter()
    wrapped = {}
    for name in torch_npu_emulation.KERNELS:
        kernel = getattr(module, name, None)
        if callable(kernel):
            wrapped[name] = kernel
            setattr(module, name, _counting(kernel, name, counter))
    try:
        yield counter
    finally:
        for name, kernel in wrapped.items():
            setattr(module, name, kernel)


def _counting(kernel: Any, name: str, counter: Counter) -> Any:
    @functools.wraps(kernel)
    def call(*args: Any, **kwargs: Any) -> Any:
        counter[name] += 1
        return kernel(*args, **kwargs)

    return call


def _rank_key(outcome: TensorOutcome, tolerance: Any) -> tuple[int, float]:
    v = final_verdict(outcome.comparison, tolerance, outcome.benchmark)
    cos = outcome.comparison.cosine
    cos = 1.0 if cos is None or math.isnan(cos) else cos
    return v.severity, -cos


def run_examples(job: Job) -> CellOutcome | None:
    """Run ``job`` on this rank; rank 0 returns the worst outcome per compared tensor."""
    patch = get_patch(job.patch_id)
    case = _case_of(patch)
    megatron_npu.apply(job.device)
    rank, _ = _rank_and_world()
    device = devices.current_torch_device()
    original = patcher.original(patch)
    tested = job.torch_dtype
    tolerance = case.tolerance_for(tested)
    level = level_of(case.name)
    cell = CellOutcome()
    cpu = torch.device("cpu")
    kernels: Counter = Counter()
    for params in job.examples:
        inputs = case.make_inputs(params)
        with _planted(job.mutation), kernel_calls() as calls:
            got = case.run(
                Context(params, tested, tested, device, original, job.parallel, rank), inputs
            )
        kernels.update(calls)
        if rank != 0:
            continue
        cpu_ctx = functools.partial(
            Context,
            params,
            tested_dtype=tested,
            device=cpu,
            original=original,
            parallel=job.parallel,
            rank=0,
        )
        want = _reference(case, patch, cpu_ctx(upcast(tested)), inputs, "reference")
        if set(got) != set(want):
            raise AssertionError(
                f"{case.name}: run returned {sorted(got)} but reference returned {sorted(want)}"
            )
        comps = {n: compare(got[n].detach().cpu(), want[n].detach().cpu(), tested) for n in got}
        floats = [n for n, c in comps.items() if c.kind == "float"]
        # 16-bit: msprobe's stage 2 needs the benchmark; fp32: only to raise the relative L2
        # bound of an output that exceeds the dtype's floor (an ill-conditioned one)
        wanted = tested in SIXTEEN_BIT or any(
            not comps[n].rel_l2 <= comps[n].rel_l2_bound for n in floats
        )
        bench = None
        # tried on every example: one example without a benchmark (e.g. dropout's observed mask)
        # must not drop stage 2 for the examples after it
        if floats and wanted:
            try:
                bench = _reference(case, patch, cpu_ctx(tested), inputs, "benchmark")
            except ReferenceHygieneError:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded; the cell keeps stage 1
                cell.benchmark_unavailable = f"{type(exc).__name__}: {exc}"
        for name in sorted(comps):
            comp, bres = comps[name], None
            if bench is not None and name in floats:
                bcomp = compare(bench[name].detach().cpu(), want[name].detach().cpu(), tested)
                comp, bres = against_benchmark(comp, bcomp, level)
            outcome = TensorOutcome(comp, bres)
            old = cell.tensors.get(name)
            if old is None or _rank_key(outcome, tolerance) > _rank_key(old, tolerance):
                cell.tensors[name] = outcome
    cell.kernels = {k: v for k, v in sorted(kernels.items()) if v > 0}
    return cell if rank == 0 else None


def _world_kept(job: Job) -> contextlib.AbstractContextManager[None]:
    """An in-process job on a device whose backend is the reference's (gloo: cpu and
    npu-emulated) keeps its one-rank world for all its examples; on an NPU the implementation's
    world is HCCL's and the reference's gloo's, so each call sets up its own."""
    from megatron_npu.parity.cases._common import one_rank_world_kept

    shared = FACTS[job.device].dist_backend == FACTS[CPU].dist_backend
    return one_rank_world_kept() if shared else contextlib.nullcontext()


def _reference(case, patch, ctx, inputs, what):
    """``case.reference`` on the CPU under :func:`reference_environment`, checked for
    hygiene (no tripwire hit, every output on the CPU)."""
    with reference_environment(patch) as hits:
        out = case.reference(ctx, inputs)
    _check_clean(hits, case, what)
    _off_cpu(out, case, what)
    return out


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`CellTimeout` in this (main) thread after ``seconds``; no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CellTimeout(f"the cell ran past its {seconds:.0f}s deadline")

    # an outer SIGALRM user (e.g. pytest-timeout's signal method) gets its handler and the rest
    # of its timer back afterwards
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds if not outer_left else min(seconds, outer_left))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:
            left = outer_left - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))


def _failure_rule(exc: BaseException) -> str:
    from megatron_npu.parity.ranks import RankTimeout

    if isinstance(exc, ReferenceHygieneError) or "ReferenceHygieneError" in str(exc):
        return "reference_hygiene"
    if isinstance(exc, (RankTimeout, CellTimeout)):
        return "timeout"
    return "crash"


def evaluate(
    job: Job, pool: Any = None, seed: int = 0, timeout_s: float = CELL_TIMEOUT_S
) -> ParityRecord:
    """Run ``job`` (in-process when world size is 1, else on ``pool``) and build its record.

    Never raises for a failing cell: an exception, a deadline passed (``timeout_s`` in-process;
    the pool's own deadline for ranks) or a reference touching the implementation becomes an
    ``error`` record naming what happened.
    """
    patch = get_patch(job.patch_id)
    case = _case_of(patch)
    start = time.perf_counter()
    failure: tuple[str, str] | None = None
    outcome: CellOutcome | None = None
    try:
        if job.parallel.world == 1:
            with _deadline(timeout_s), _world_kept(job):
                outcome = run_examples(job)
        else:
            if pool is None:
                raise ValueError(f"{job.patch_id}: parallel size {job.parallel} needs a rank pool")
            outcome = pool.submit(job)
        if outcome is None or not outcome.tensors:
            raise AssertionError(f"{case.name}: the cell compared no tensor")
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record
        rule = _failure_rule(exc)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        failure = (rule, detail[-2000:])
    provenance = collect_provenance(job.device, seed=seed, wall_time_s=time.perf_counter() - start)
    common = dict(
        patch_id=patch.id,
        target=patch.target,
        case=case.name,
        dtype=dtype_name(job.torch_dtype),
        parallel=job.parallel.as_dict(),
        provenance=provenance,
        tolerance=case.tolerance_for(job.torch_dtype),
    )
    if failure is not None:
        return failed_record(rule=failure[0], reason=failure[1], **common)
    assert outcome is not None
    return build_record(
        comparisons={n: o.comparison for n, o in outcome.tensors.items()},
        benchmarks={n: o.benchmark for n, o in outcome.tensors.items()},
        benchmark_level=level_of(case.name),
        benchmark_unavailable=outcome.benchmark_unavailable,
        kernels=outcome.kernels,
        **common,
    )


def mutation_job(mutation: Mutation, with_bug: bool = True) -> Job:
    """The parity job that must catch ``mutation`` (carrying it when planted per run)."""
    return Job(
        patch_id=mutation.patch_id,
        device=mutation.device,
        dtype=mutation.dtype,
        parallel=mutation.parallel,
        examples=mutation.examples,
        mutation=mutation.name if with_bug and mutation.scope == "run" else None,
    )


def evaluate_mutation(mutation: Mutation, with_bug: bool, pool: Any = None) -> ParityRecord:
    """The parity record of ``mutation``'s job, with or without the bug in place."""
    job = mutation_job(mutation, with_bug)
    if with_bug and mutation.scope == "job":
        with mutation.plant():
            return evaluate(job)
    return evaluate(job, pool=pool)
