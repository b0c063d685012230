"""Parity of the numpy dataset-index helpers against megatron-core's compiled ``helpers_cpp``.

Index arrays are integers, so the comparison is exact (any differing element is an error); the
matrix's dtype axis does not apply and each case declares float32 only, meaning "one run".
"""

from __future__ import annotations

import numpy
import torch
from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import FP32_ONLY


def _rng(p) -> numpy.random.Generator:
    return numpy.random.default_rng(p["seed"])


def _documents(p):
    rng = _rng(p)
    sizes = rng.integers(1, p["max_doc"], size=p["docs"]).astype(numpy.int32)
    doc_idx = numpy.concatenate([rng.permutation(p["docs"]) for _ in range(p["epochs"])])
    return sizes, doc_idx.astype(numpy.int32)


def _sample_idx(fn, p):
    sizes, doc_idx = _documents(p)
    tokens = int(sizes.sum())
    out = fn(sizes, doc_idx, p["seq"], p["epochs"], tokens, p["drop_last"], p["extra"])
    return {"sample_idx": torch.from_numpy(numpy.asarray(out).astype(numpy.int64))}


def _blending(fn, p):
    rng = _rng(p)
    weights = rng.random(p["datasets"]) + 0.05
    weights = weights / weights.sum()
    index = numpy.zeros(p["size"], dtype=numpy.int16)
    sample = numpy.zeros(p["size"], dtype=numpy.int64)
    fn(index, sample, weights, p["datasets"], p["size"], False)
    return {
        "dataset_index": torch.from_numpy(index.astype(numpy.int64)),
        "dataset_sample_index": torch.from_numpy(sample),
    }


def _exhaustive(fn, p):
    rng = _rng(p)
    sizes = rng.integers(1, 50, size=p["datasets"]).astype(numpy.int64)
    total = int(sizes.sum())
    index = numpy.zeros(total, dtype=numpy.int16)
    sample = numpy.zeros(total, dtype=numpy.int64)
    fn(index, sample, sizes, p["datasets"])
    return {
        "dataset_index": torch.from_numpy(index.astype(numpy.int64)),
        "dataset_sample_index": torch.from_numpy(sample),
    }


def _patched(name):
    def run(ctx: Context, inputs):
        from megatron.core.datasets import helpers

        return _CALLS[name](getattr(helpers, name), ctx.params)

    return run


def _original(name):
    def reference(ctx: Context, inputs):
        return _CALLS[name](ctx.original, ctx.params)

    return reference


_CALLS = {
    "build_sample_idx": _sample_idx,
    "build_blending_indices": _blending,
    "build_exhaustive_blending_indices": _exhaustive,
}


def _case(name, params, compares, edge_cases=()):
    return ParityCase(
        name=f"data.{name}",
        params=params,
        make_inputs=lambda p: {},
        run=_patched(name),
        reference=_original(name),
        compares=compares,
        edge_cases=edge_cases,
        dtypes=FP32_ONLY,
        reference_kind="megatron-core's compiled helpers_cpp (exact)",
    )


BUILD_SAMPLE_IDX = _case(
    "build_sample_idx",
    st.fixed_dictionaries(
        {
            "docs": st.integers(1, 60),
            "max_doc": st.integers(2, 300),
            "seq": st.integers(1, 128),
            "epochs": st.integers(1, 3),
            "drop_last": st.booleans(),
            "extra": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    ),
    "the [num_samples + 1, 2] (document, offset) sample index",
    edge_cases=(
        {
            "docs": 1,
            "max_doc": 2,
            "seq": 1,
            "epochs": 1,
            "drop_last": True,
            "extra": True,
            "seed": 0,
        },
    ),
)
BUILD_BLENDING_INDICES = _case(
    "build_blending_indices",
    st.fixed_dictionaries(
        {"datasets": st.integers(1, 6), "size": st.integers(1, 2000), "seed": st.integers(0, 2**16)}
    ),
    "per-sample dataset id and the sample's index within it",
)
BUILD_EXHAUSTIVE_BLENDING_INDICES = _case(
    "build_exhaustive_blending_indices",
    st.fixed_dictionaries({"datasets": st.integers(1, 6), "seed": st.integers(0, 2**16)}),
    "per-sample dataset id and the sample's index within it, every sample used once",
)
