"""Run one benchmark cell under pytest-benchmark and label it per the benchmarks interface.

``extra_info`` keys (documented in ``perf/README.md``, section JSON): ``patch_id``, ``op``,
``path``, ``device``, ``emulated``, ``dtype``, ``shape``, ``direction``, ``peak_memory_bytes``;
``group`` is the op name so the paths of one op line up in pytest-benchmark's tables.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch

import megatron_npu
from megatron_npu.ops import settings
from megatron_npu.training import peak as peak_flops
from perf.case import Built, Cell
from perf.memory import peak_allocated_bytes


@contextlib.contextmanager
def adaptor_for(cell: Cell) -> Iterator[None]:
    """The adaptor applied for the cell's device: ``cpu`` (Megatron's own code needs its device
    routing here too) or ``npu-emulated`` (the op layer calls the torch_npu emulation)."""
    megatron_npu.apply(cell.device)
    try:
        yield
    finally:
        megatron_npu.restore()
        settings.reset()


def _outputs(result: Any) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def timed_call(cell: Cell, built: Built) -> Callable[[], Any]:
    """The callable the benchmark times: forward only (no autograd graph), forward+backward
    (grads of the leaves reset first, upstream gradient fixed), or one optimizer step."""
    if cell.direction != "fwd+bwd":

        def forward() -> Any:
            with torch.no_grad():
                return built.run()

        return forward
    first = _outputs(built.run())
    if not first:
        raise ValueError(f"benchmark {cell.id()}: fwd+bwd but the op returned no grad output")
    gen = torch.Generator().manual_seed(0)
    upstream = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in first]
    del first

    def forward_backward() -> None:
        for leaf in built.leaves:
            leaf.grad = None
        torch.autograd.backward(_outputs(built.run()), upstream)

    return forward_backward


def run_cell(
    benchmark: Any, cell: Cell, build: Callable[[Cell], Built], rounds: int, **extra: Any
) -> None:
    """Time ``cell`` (``rounds`` rounds after one warm-up) and record its peak memory."""
    with adaptor_for(cell):
        built = build(cell)
        fn = timed_call(cell, built)
        fn()  # warm-up outside the profiler: lazy initialisation is not the op's memory
        for leaf in built.leaves:  # free the warm-up's grads before, not during, the probe
            leaf.grad = None
        peak = peak_allocated_bytes(fn)
        benchmark.group = cell.op
        benchmark.extra_info.update(
            patch_id=cell.patch_id,
            op=cell.op,
            path=cell.path,
            device=cell.device,
            emulated=cell.emulated,
            dtype=cell.dtype,
            shape=cell.shape_text(),
            direction=cell.direction,
            peak_memory_bytes=peak,
            torch_threads=torch.get_num_threads(),
            **extra,
        )
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
    if built.forward_flops is not None and not cell.emulated:
        passes = 3 if cell.direction == "fwd+bwd" else 1  # backward: data and weight gradients
        record_mfu(benchmark, built.forward_flops * passes, cell.device, cell.torch_dtype)


def record_mfu(benchmark: Any, model_flops: float, device: str, dtype: torch.dtype) -> None:
    """Record ``model_flops_per_call``, ``achieved_tflops`` (model FLOPs over the median time),
    the per-device peak it is measured against and ``mfu``. Not for emulated cells: their time
    is the emulation's. Nothing under ``--benchmark-disable``: the function ran once, untimed."""
    if benchmark.stats is None:
        return
    median = statistics.median(benchmark.stats.stats.data)
    figure = peak_flops.measured_peak_flops(device, dtype)
    achieved = model_flops / median
    benchmark.extra_info.update(
        model_flops_per_call=model_flops,
        achieved_tflops=achieved / 1e12,
        peak_tflops=figure.tflops,
        peak_source=figure.source,
        mfu=peak_flops.mfu(achieved, figure),
    )
