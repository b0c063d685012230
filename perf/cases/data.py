"""Dataset index building: megatron-core's compiled ``helpers_cpp`` vs the numpy replacements,
at a 1B-token-scale index (2M documents, sequence 2048) and blends of 4 datasets over 20M
samples. Integer work: no dtype axis (recorded as float32, meaning "one run"), direction
``step``; no NPU kernel is involved.
"""

from __future__ import annotations

from perf.case import BenchCase, Built, Cell, implementation


def _params(cell: Cell) -> dict:
    return {"seed": 0, "drop_last": True, "extra": 1, **cell.shape}


def _sample_idx(cell: Cell) -> Built:
    from megatron_npu.parity.cases.data import _sample_idx as run

    fn, p = implementation(cell), _params(cell)
    return Built(lambda: run(fn, p))


def _blending(cell: Cell) -> Built:
    from megatron_npu.parity.cases.data import _blending as run

    fn, p = implementation(cell), _params(cell)
    return Built(lambda: run(fn, p))


def _exhaustive(cell: Cell) -> Built:
    from megatron_npu.parity.cases.data import _exhaustive as run

    fn, p = implementation(cell), _params(cell)
    return Built(lambda: run(fn, p))


def _case(op: str, build, full: dict, quick: dict) -> BenchCase:
    return BenchCase(
        op=op,
        shapes={"full": full, "quick": quick},
        build=build,
        paths=("megatron", "native"),
        dtypes=("float32",),
        directions=("step",),
    )


BUILD_SAMPLE_IDX = _case(
    "sample-index",
    _sample_idx,
    {"docs": 2_000_000, "max_doc": 1000, "epochs": 1, "seq": 2048},
    {"docs": 20_000, "max_doc": 1000, "epochs": 1, "seq": 2048},
)
BUILD_BLENDING_INDICES = _case(
    "blending-index",
    _blending,
    {"datasets": 4, "size": 20_000_000},
    {"datasets": 4, "size": 200_000},
)
BUILD_EXHAUSTIVE_BLENDING_INDICES = _case(
    "exhaustive-blending-index",
    _exhaustive,
    {"datasets": 4},
    {"datasets": 4},
)
