"""What a patch's benchmark declares, and the cells (path x dtype x direction) it expands to.

A registry :class:`~megatron_npu.registry.Patch` names its case as ``benchmark="module:NAME"``.
The case builds, for one :class:`Cell`, a thunk that runs the op once; the generated suite
(``perf/test_patched_ops_bench.py``) times it and records its peak memory.

Paths (the ``path`` key of a benchmark's ``extra_info``):

* ``megatron`` -- the stock Megatron-Core implementation, as Megatron runs it on this machine
  without apex/TransformerEngine (its own fallback where the fused kernel is CUDA-only);
* ``native`` -- the adaptor's replacement with the native torch path (no NPU kernel module);
* ``npu-binding`` -- the same replacement calling torch_npu's kernel. Here that is the pure-torch
  emulation (device ``npu-emulated``, ``emulated: true``): its time says nothing about an NPU
  and is never compared for speed with the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_npu.devices.facts import CPU, NPU_EMULATED

PATHS = ("megatron", "native", "npu-binding")
DIRECTIONS = ("fwd", "fwd+bwd", "step")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = ("full", "quick")


@dataclass(frozen=True)
class Cell:
    """One benchmark: a patch's op on one path, dtype, direction and shape."""

    patch_id: str
    op: str
    path: str
    dtype: str
    direction: str
    shape: Mapping[str, int]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def device(self) -> str:
        return NPU_EMULATED if self.path == "npu-binding" else CPU

    @property
    def emulated(self) -> bool:
        return self.path == "npu-binding"

    def shape_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.shape.items())

    def id(self) -> str:
        return f"{self.patch_id}-{self.path}-{self.dtype}-{self.direction}"


@dataclass(frozen=True)
class Built:
    """What a case hands the runner for one cell: ``run()`` executes the op once and returns the
    tensor(s) to back-propagate (fwd+bwd), ``leaves`` are the inputs whose grads it resets.
    ``forward_flops``, where given, is the model FLOPs one forward is credited with (an MoE
    layer's: only the experts each token is routed to); the runner then records MFU."""

    run: Callable[[], Any]
    leaves: tuple[torch.Tensor, ...] = ()
    forward_flops: float | None = None


@dataclass(frozen=True)
class BenchCase:
    """A patch's benchmark: sizes that matter (``full``) and a smoke size (``quick``).

    ``build(cell)`` prepares inputs and returns a :class:`Built`. ``emulated_size`` is the size
    the ``npu-binding`` path runs at (the emulation builds explicit score matrices and is slow;
    its figures are never compared for speed, so a smaller shape keeps the suite in budget).
    """

    op: str
    shapes: Mapping[str, Mapping[str, int]]
    build: Callable[[Cell], Built]
    paths: tuple[str, ...] = PATHS
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    directions: tuple[str, ...] = ("fwd", "fwd+bwd")
    rounds: int = 3
    emulated_size: str = "quick"
    note: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, allowed, got in (
            ("paths", PATHS, self.paths),
            ("dtypes", DTYPES, self.dtypes),
            ("directions", DIRECTIONS, self.directions),
        ):
            bad = [x for x in got if x not in allowed]
            if bad or not got:
                raise ValueError(f"benchmark {self.op!r}: {name} {bad or got} not in {allowed}")
        missing = [s for s in SIZES if s not in self.shapes]
        if missing:
            raise ValueError(f"benchmark {self.op!r}: shapes lack {missing}")

    def cells(self, patch_id: str, size: str) -> list[Cell]:
        out = []
        for path in self.paths:
            shape = self.shapes[self.emulated_size if path == "npu-binding" else size]
            for dtype in self.dtypes:
                for direction in self.directions:
                    out.append(Cell(patch_id, self.op, path, dtype, direction, dict(shape)))
        return out


def original_of(cell: Cell) -> Any:
    """The stock Megatron object the cell's patch replaces (valid while the adaptor is applied)."""
    from megatron_npu import patcher
    from megatron_npu.registry import get_patch

    return patcher.original(get_patch(cell.patch_id))


def installed_of(cell: Cell) -> Any:
    """The object now installed at the patch's target (the replacement, once applied)."""
    from megatron_npu import patcher
    from megatron_npu.registry import get_patch

    owner, name = patcher.resolve(get_patch(cell.patch_id).target)
    return getattr(owner, name)


def implementation(cell: Cell) -> Any:
    """Megatron's original on the ``megatron`` path, the installed replacement otherwise."""
    return original_of(cell) if cell.path == "megatron" else installed_of(cell)


def load_benchmark(ref: str) -> BenchCase:
    """``"package.module:NAME"`` -> the :class:`BenchCase` it names (clear error otherwise)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"benchmark reference {ref!r} is not 'module:NAME'")
    case = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(case, BenchCase):
        raise LookupError(f"benchmark reference {ref!r} does not name a BenchCase")
    return case
