"""Pure-numpy replacements for megatron-core's compiled dataset index helpers.

megatron-core builds its GPT sample index and its blend indices with the C++ extension
``megatron.core.datasets.helpers_cpp`` (source: ``megatron/core/datasets/helpers.cpp``), which must
be compiled for the machine (``compile_helpers()`` needs a C++ compiler and pybind11). The functions
here reproduce that C++ code exactly (same arguments, same dtypes, same values) without a compiler.

Where megatron-core 0.16.1 calls the helpers (every call site imports the module inside the
function and looks the attribute up at call time)::

    megatron/core/datasets/gpt_dataset.py      from megatron.core.datasets import helpers
                                               helpers.build_sample_idx(...)
    megatron/core/datasets/blended_dataset.py  helpers.build_blending_indices(...)
                                               helpers.build_exhaustive_blending_indices(...)
    megatron/core/datasets/masked_dataset.py   helpers.build_mapping(...)   (BERT/T5 only)

So replacing these module attributes is enough (no module holds a ``from ... import`` copy):

============================================  =========================================
target in ``megatron.core.datasets.helpers``  replacement (this module)
============================================  =========================================
``build_sample_idx``                          :func:`build_sample_idx`
``build_blending_indices``                    :func:`build_blending_indices`
``build_exhaustive_blending_indices``         :func:`build_exhaustive_blending_indices`
============================================  =========================================

``helpers.build_sample_idx`` is a Python wrapper (it picks ``build_sample_idx_int32`` or
``build_sample_idx_int64`` from ``helpers_cpp``); :func:`build_sample_idx` reproduces the wrapper,
and :func:`build_sample_idx_int32` / :func:`build_sample_idx_int64` reproduce the two C++ functions.
The two blending targets are pybind11 builtins (``inspect.signature`` cannot read them).

``build_mapping`` / ``build_blocks_mapping`` (BERT, T5 and ICT datasets; they need ``std::mt19937``
streams) are not reimplemented: the GPT pipeline never calls them.

If ``megatron.core.datasets.helpers`` cannot be imported at all (no compiled ``helpers_cpp`` for the
platform), :func:`install_numpy_helpers` registers a stand-in module under that name instead.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import threading
import types
from collections.abc import Iterator, Sequence

import numpy

from megatron_npu import console

__all__ = [
    "HELPERS_MODULE",
    "PATCH_TARGETS",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "build_sample_idx",
    "build_sample_idx_int32",
    "build_sample_idx_int64",
    "install_numpy_helpers",
    "numpy_helpers",
    "numpy_helpers_installed",
    "restore_helpers",
]

HELPERS_MODULE = "megatron.core.datasets.helpers"


def _c_div(numerator: int, denominator: int) -> int:
    """C++ integer division (truncates toward zero)."""
    quotient = abs(numerator) // abs(denominator)
    return quotient if (numerator >= 0) == (denominator > 0) else -quotient


def _build_sample_idx_impl(
    sizes: numpy.ndarray,
    document_idx: numpy.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool,
    add_extra_token_to_sequence: int,
    dtype: type[numpy.integer],
) -> numpy.ndarray:
    sizes = numpy.asarray(sizes, dtype=numpy.int32)
    document_idx = numpy.asarray(document_idx, dtype=numpy.int32)
    seq_length = int(numpy.int32(seq_length))
    extra = int(add_extra_token_to_sequence)
    total = int(num_epochs) * int(tokens_per_epoch)

    if drop_last_partial_sequence:
        num_samples = _c_div(total - extra, seq_length)
    else:
        # helpers.cpp: ceil(float(num_epochs * tokens_per_epoch - extra) / seq_length), computed in
        # single precision; reproduce the float32 rounding exactly.
        quotient = numpy.float32(total - extra) / numpy.float32(seq_length)
        num_samples = int(numpy.ceil(quotient, dtype=numpy.float32))
    if num_samples < 0:
        raise ValueError(
            f"build_sample_idx: negative number of samples ({num_samples}) for "
            f"num_epochs={num_epochs}, tokens_per_epoch={tokens_per_epoch}"
        )

    sample_idx = numpy.zeros((num_samples + 1, 2), dtype=dtype)
    if num_samples == 0:
        return sample_idx

    # Sample i ends (exclusive) at global token position i * seq_length of the flattened
    # document stream; the C++ loop stores the first document j whose end satisfies
    # cum[j + 1] >= position + extra, with the offset into that document. When it runs out of
    # documents it stores the last document with offset sizes[last] - extra.
    doc_sizes = sizes[document_idx].astype(numpy.int64)
    doc_ends = numpy.cumsum(doc_sizes)
    doc_starts = doc_ends - doc_sizes
    positions = numpy.arange(1, num_samples + 1, dtype=numpy.int64) * seq_length
    doc = numpy.searchsorted(doc_ends, positions + extra, side="left")
    past_end = doc >= len(document_idx)
    last = len(document_idx) - 1
    doc = numpy.where(past_end, last, doc)
    offset = numpy.where(past_end, doc_sizes[last] - extra, positions - doc_starts[doc])
    sample_idx[1:, 0] = doc
    sample_idx[1:, 1] = offset
    return sample_idx


def build_sample_idx_int32(
    sizes: numpy.ndarray,
    document_idx: numpy.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> numpy.ndarray:
    """``helpers_cpp.build_sample_idx_int32``: the ``[num_samples + 1, 2]`` int32 sample index."""
    return _build_sample_idx_impl(
        sizes,
        document_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        add_extra_token_to_sequence,
        numpy.int32,
    )


def build_sample_idx_int64(
    sizes: numpy.ndarray,
    document_idx: numpy.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> numpy.ndarray:
    """``helpers_cpp.build_sample_idx_int64``: the ``[num_samples + 1, 2]`` int64 sample index."""
    return _build_sample_idx_impl(
        sizes,
        document_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        add_extra_token_to_sequence,
        numpy.int64,
    )


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """Replacement for ``megatron.core.datasets.helpers.build_sample_idx`` (same signature).

    Row ``i`` of the result is ``(index into document_indices, token offset in that document)``
    where sample ``i`` starts; row ``i + 1`` is where it ends. int32 when every value fits, else
    int64, exactly as megatron-core's wrapper decides.
    """
    sample_idx_max = max(document_indices.shape[0], sizes.max())
    if sample_idx_max <= numpy.iinfo(numpy.int32).max:
        sample_idx = build_sample_idx_int32(
            sizes,
            document_indices,
            sequence_length,
            num_epochs,
            tokens_per_epoch,
            drop_last_partial_sequence,
            1 if add_extra_token_to_sequence else 0,
        )
        assert sample_idx.min() >= 0 and sample_idx.max() <= sample_idx_max
    else:
        sample_idx = build_sample_idx_int64(
            sizes,
            document_indices,
            sequence_length,
            num_epochs,
            tokens_per_epoch,
            drop_last_partial_sequence,
            1 if add_extra_token_to_sequence else 0,
        )
    return sample_idx


def build_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    weights: Sequence[float] | numpy.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool,
) -> None:
    """Replacement for ``helpers.build_blending_indices``: fill the two arrays in place.

    Sample ``i`` goes to the dataset with the largest sampling error
    ``weights[d] * max(i, 1) - drawn[d]`` (first dataset on ties), with the same double-precision
    arithmetic as helpers.cpp, so the result is bit-identical.
    """
    num_datasets = int(num_datasets)
    size = int(size)
    w = [float(x) for x in numpy.asarray(weights, dtype=numpy.float64)[:num_datasets]]
    if len(w) != num_datasets:
        raise ValueError(f"build_blending_indices: {len(w)} weights for {num_datasets} datasets")
    if verbose:
        console.say("> building indices for blended datasets ...")
    counts = [0] * num_datasets
    chosen = [0] * size
    drawn = [0] * size
    others = range(1, num_datasets)
    w0 = w[0]
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best = 0
        best_error = w0 * x - counts[0]
        for d in others:
            error = w[d] * x - counts[d]
            if error > best_error:
                best_error = error
                best = d
        chosen[i] = best
        drawn[i] = counts[best]
        counts[best] += 1
    dataset_index[:size] = numpy.asarray(chosen, dtype=numpy.int16)
    dataset_sample_index[:size] = numpy.asarray(drawn, dtype=numpy.int64)
    if verbose:
        console.say(" > sample ratios:")
        for d in range(num_datasets):
            ratio = counts[d] / size if size else math.nan
            console.say(f"   dataset {d}, input: {w[d]:g}, achieved: {ratio:g}")


def build_exhaustive_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    sizes: Sequence[int] | numpy.ndarray,
    num_datasets: int,
) -> None:
    """Replacement for ``helpers.build_exhaustive_blending_indices``: fill the arrays in place.

    Draws exactly ``sizes[d]`` samples from every dataset ``d``, interleaved in proportion to the
    sizes (largest error first, lowest dataset index on ties, exhausted datasets leave the race).
    """
    num_datasets = int(num_datasets)
    n = [int(s) for s in numpy.asarray(sizes, dtype=numpy.int64)[:num_datasets]]
    if len(n) != num_datasets:
        raise ValueError(f"build_exhaustive_blending_indices: {len(n)} sizes, {num_datasets} sets")
    if any(s <= 0 for s in n):
        # helpers.cpp never terminates for an empty dataset; megatron asserts sizes > 0 before.
        raise ValueError(f"build_exhaustive_blending_indices: sizes must be positive, got {n}")
    total = sum(n)
    weights = [s / float(total) for s in n]
    counts = [0] * num_datasets
    unspent = list(range(num_datasets))  # kept sorted, like the std::set in helpers.cpp
    chosen = [0] * total
    drawn = [0] * total
    for i in range(total):
        x = float(i) if i > 1 else 1.0
        best = -1
        best_error = -math.inf
        for d in unspent:
            error = weights[d] * x - counts[d]
            if best < 0 or error > best_error:
                best_error = error
                best = d
        chosen[i] = best
        drawn[i] = counts[best]
        counts[best] += 1
        if counts[best] == n[best]:
            unspent.remove(best)
    dataset_index[:total] = numpy.asarray(chosen, dtype=numpy.int16)
    dataset_sample_index[:total] = numpy.asarray(drawn, dtype=numpy.int64)


#: helper attribute name -> replacement, for every attribute :func:`install_numpy_helpers` sets.
_REPLACEMENTS = {
    "build_sample_idx": build_sample_idx,
    "build_sample_idx_int32": build_sample_idx_int32,
    "build_sample_idx_int64": build_sample_idx_int64,
    "build_blending_indices": build_blending_indices,
    "build_exhaustive_blending_indices": build_exhaustive_blending_indices,
}

#: The dotted targets megatron-core actually calls, mapped to their replacements.
PATCH_TARGETS = {
    f"{HELPERS_MODULE}.build_sample_idx": build_sample_idx,
    f"{HELPERS_MODULE}.build_blending_indices": build_blending_indices,
    f"{HELPERS_MODULE}.build_exhaustive_blending_indices": build_exhaustive_blending_indices,
}

_MISSING = object()
_lock = threading.RLock()
_saved: dict[str, object] = {}
_stand_in: types.ModuleType | None = None
_stand_in_parent_attr: object = _MISSING
_stand_in_sys_modules_entry: object = _MISSING


def _missing_helper(name: str):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"{HELPERS_MODULE}.{name} needs the compiled helpers_cpp extension, which is not "
            "available here; megatron_npu.data.index_helpers only replaces the GPT helpers"
        )

    unavailable.__name__ = name
    return unavailable


def numpy_helpers_installed() -> bool:
    """Whether megatron-core's helpers currently resolve to the numpy implementations."""
    module = sys.modules.get(HELPERS_MODULE)
    if module is None:
        return False
    return all(getattr(module, name, None) is fn for name, fn in _REPLACEMENTS.items())


def install_numpy_helpers() -> bool:
    """Make megatron-core's dataset code use the numpy helpers. Idempotent.

    Replaces the attributes listed in ``_REPLACEMENTS`` on ``megatron.core.datasets.helpers``
    (remembering the originals), or, when that module cannot be imported because the compiled
    extension is missing, registers a stand-in module under its name. Returns True when this call
    changed anything.
    """
    global _stand_in, _stand_in_parent_attr, _stand_in_sys_modules_entry
    with _lock:
        if numpy_helpers_installed():
            return False
        try:
            module = importlib.import_module(HELPERS_MODULE)
        except ImportError:
            package = importlib.import_module("megatron.core.datasets")
            module = types.ModuleType(HELPERS_MODULE, "numpy stand-in for megatron helpers_cpp")
            module.build_mapping = _missing_helper("build_mapping")
            module.build_blocks_mapping = _missing_helper("build_blocks_mapping")
            _stand_in = module
            _stand_in_parent_attr = package.__dict__.get("helpers", _MISSING)
            _stand_in_sys_modules_entry = sys.modules.get(HELPERS_MODULE, _MISSING)
            sys.modules[HELPERS_MODULE] = module
            package.helpers = module
        for name, fn in _REPLACEMENTS.items():
            current = module.__dict__.get(name, _MISSING)
            if current is not fn and name not in _saved:
                _saved[name] = current
            setattr(module, name, fn)
        return True


def restore_helpers() -> None:
    """Undo :func:`install_numpy_helpers`: put back exactly the original helper objects."""
    global _stand_in, _stand_in_parent_attr, _stand_in_sys_modules_entry
    with _lock:
        if _stand_in is not None:
            if sys.modules.get(HELPERS_MODULE) is _stand_in:
                if _stand_in_sys_modules_entry is _MISSING:
                    del sys.modules[HELPERS_MODULE]
                else:  # e.g. None, which is how an import is blocked
                    sys.modules[HELPERS_MODULE] = _stand_in_sys_modules_entry
            package = sys.modules.get("megatron.core.datasets")
            if package is not None and package.__dict__.get("helpers") is _stand_in:
                if _stand_in_parent_attr is _MISSING:
                    delattr(package, "helpers")
                else:
                    package.helpers = _stand_in_parent_attr
            _stand_in = None
            _stand_in_parent_attr = _MISSING
            _stand_in_sys_modules_entry = _MISSING
            _saved.clear()
            return
        module = sys.modules.get(HELPERS_MODULE)
        if module is not None:
            for name, original in _saved.items():
                if original is _MISSING:
                    module.__dict__.pop(name, None)
                else:
                    setattr(module, name, original)
        _saved.clear()


@contextlib.contextmanager
def numpy_helpers() -> Iterator[None]:
    """Context manager: numpy helpers inside; restored on exit only if this context installed
    them (so it leaves a registry patch, or an outer installation, in place)."""
    with _lock:
        installed_here = install_numpy_helpers()
        try:
            yield
        finally:
            if installed_here:
                restore_helpers()
