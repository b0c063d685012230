"""The numpy index helpers against megatron-core's compiled C++ helpers and a plain-Python
transcription of helpers.cpp, and their installation into megatron-core."""

from __future__ import annotations

import importlib
import math
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from megatron_npu.data import index_helpers as nh

# -- plain-Python transcriptions of megatron/core/datasets/helpers.cpp -----------------------------


def ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    total = num_epochs * tokens_per_epoch - extra
    if drop_last:
        num_samples = total // seq_length if total >= 0 else -(-total // seq_length)
    else:
        num_samples = math.ceil(float(np.float32(total) / np.float32(seq_length)))
    out = [(0, 0)]
    index, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[doc_idx[index]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if index == len(doc_idx) - 1:
                    offset = int(sizes[doc_idx[index]]) - extra
                    break
                index += 1
                offset = 0
        out.append((index, offset))
    return out


def ref_blending(weights, num_datasets, size):
    counts = [0] * num_datasets
    index, sample = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = 0, weights[0] * x - counts[0]
        for d in range(1, num_datasets):
            error = weights[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return index, sample


def ref_exhaustive(sizes):
    total = sum(sizes)
    weights = [s / total for s in sizes]
    counts = [0] * len(sizes)
    unspent = set(range(len(sizes)))
    index, sample = [], []
    i = 0
    while unspent:
        x = max(float(i), 1.0)
        best, best_error = -1, -sys.float_info.max
        for d in sorted(unspent):
            error = weights[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
        if sizes[best] - counts[best] == 0:
            unspent.discard(best)
        i += 1
    return index, sample


def _random_sample_idx_cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for case in range(n):
        num_docs = int(rng.integers(1, 40))
        low = 0 if case % 3 == 0 else 1  # some cases with empty documents
        sizes = rng.integers(low, 60, size=num_docs).astype(np.int32)
        sizes[int(rng.integers(num_docs))] += 2
        epochs = int(rng.integers(1, 4))
        doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(epochs)]).astype(
            np.int32
        )
        yield (
            sizes,
            doc_idx,
            int(rng.integers(1, 40)),
            epochs,
            int(sizes.sum()),
            bool(rng.integers(2)),
            int(rng.integers(2)),
        )


def _random_weights(n: int, seed: int):
    # exact ties first: the lowest dataset index must win them
    for k in (2, 3, 4):
        yield [1.0 / k] * k, k, 999
    yield [0.25, 0.5, 0.25], 3, 1000
    rng = np.random.default_rng(seed)
    for _ in range(n):
        k = int(rng.integers(1, 7))
        w = rng.random(k) + 0.01
        yield [float(x) for x in w / w.sum()], k, int(rng.integers(0, 4000))


# -- against the Python reference (always runs) ----------------------------------------------------


def test_sample_idx_matches_python_reference():
    for args in _random_sample_idx_cases(300, seed=1):
        for fn, dtype in (
            (nh.build_sample_idx_int32, np.int32),
            (nh.build_sample_idx_int64, np.int64),
        ):
            got = fn(*args)
            assert got.dtype == dtype and got.flags.c_contiguous
            assert got.tolist() == [list(r) for r in ref_sample_idx(*args)], args


def test_sample_idx_wrapper_matches_reference_and_megatron_signature():
    import inspect

    from megatron.core.datasets import helpers

    original = helpers.build_sample_idx
    assert original is not nh.build_sample_idx

    def shape(fn):
        params = inspect.signature(fn).parameters.values()
        return [(p.name, p.kind, p.default) for p in params]

    assert shape(original) == shape(nh.build_sample_idx)
    sizes = np.array([5, 0, 7, 3, 9], np.int32)
    docs = np.array([4, 2, 0, 1, 3, 2, 4, 1, 0, 3], np.int32)
    for drop_last in (True, False):
        for extra in (True, False):
            got = nh.build_sample_idx(sizes, docs, 4, 2, 24, drop_last, extra)
            assert got.dtype == np.int32
            want = ref_sample_idx(sizes, docs, 4, 2, 24, drop_last, int(extra))
            assert got.tolist() == [list(r) for r in want]


def test_blending_matches_python_reference():
    for weights, k, size in _random_weights(40, seed=2):
        index = np.full(size, -1, np.int16)
        sample = np.full(size, -1, np.int64)
        nh.build_blending_indices(index, sample, weights, k, size, False)
        want_index, want_sample = ref_blending(weights, k, size)
        assert index.tolist() == want_index and sample.tolist() == want_sample


def test_exhaustive_blending_matches_python_reference():
    rng = np.random.default_rng(3)
    cases = [[100, 100], [7, 7, 7], [5, 10, 5]]
    cases += [
        [int(s) for s in rng.integers(1, 400, size=int(rng.integers(1, 7)))] for _ in range(40)
    ]
    for sizes in cases:
        index = np.full(sum(sizes), -1, np.int16)
        sample = np.full(sum(sizes), -1, np.int64)
        nh.build_exhaustive_blending_indices(index, sample, sizes, len(sizes))
        want_index, want_sample = ref_exhaustive(sizes)
        assert index.tolist() == want_index and sample.tolist() == want_sample
        assert np.bincount(index, minlength=len(sizes)).tolist() == sizes


def test_blending_verbose_prints_ratios(capsys):
    index = np.zeros(10, np.int16)
    sample = np.zeros(10, np.int64)
    nh.build_blending_indices(index, sample, [0.5, 0.5], 2, 10, True)
    out = capsys.readouterr().out
    assert "building indices for blended datasets" in out and "achieved: 0.5" in out


# -- against the compiled C++ helpers --------------------------------------------------------------


def _compile_helpers_cpp(build_dir: str):
    """Compile megatron's helpers.cpp into ``build_dir``. pybind11 is a test dependency and the
    README's test command installs g++, so a failure here fails the tests, never skips them."""
    import megatron.core.datasets as pkg
    import pybind11  # the `test` extra: a missing one must fail, not skip

    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler is not None, "no C++ compiler (c++ / g++) to build megatron's helpers_cpp"
    source = os.path.join(os.path.dirname(pkg.__file__), "helpers.cpp")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = os.path.join(build_dir, "helpers_cpp" + suffix)
    cmd = [
        compiler,
        "-O3",
        "-Wall",
        "-shared",
        "-std=c++11",
        "-fPIC",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        source,
        "-o",
        target,
    ]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"building helpers_cpp failed: {built.stderr[-3000:]}"
    spec = importlib.util.spec_from_file_location("helpers_cpp", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    """The compiled C++ helpers: megatron-core's shipped build, else one compiled here."""
    try:
        return importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return _compile_helpers_cpp(str(tmp_path_factory.mktemp("helpers_cpp")))


@pytest.mark.slow
def test_helpers_cpp_builds_here_and_agrees(tmp_path):
    """The build the fixture falls back to (a wheel without helpers_cpp) works: pybind11 + g++
    compile Megatron's helpers.cpp, and the build agrees byte for byte."""
    built = _compile_helpers_cpp(str(tmp_path))
    for args in _random_sample_idx_cases(20, seed=9):
        a, b = nh.build_sample_idx_int64(*args), built.build_sample_idx_int64(*args)
        assert a.tobytes() == b.tobytes(), args


def test_sample_idx_byte_identical_to_cpp(cpp):
    for args in _random_sample_idx_cases(300, seed=4):
        for ours, theirs in (
            (nh.build_sample_idx_int32, cpp.build_sample_idx_int32),
            (nh.build_sample_idx_int64, cpp.build_sample_idx_int64),
        ):
            a, b = ours(*args), theirs(*args)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), args
            assert a.tobytes() == b.tobytes(), args


def test_sample_idx_large_input_identical_to_cpp(cpp):
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 3000, size=50_000).astype(np.int32)
    docs = np.concatenate([rng.permutation(50_000), rng.permutation(50_000)]).astype(np.int32)
    for drop_last in (True, False):
        args = (sizes, docs, 1024, 2, int(sizes.sum()), drop_last, 1)
        assert (
            nh.build_sample_idx_int32(*args).tobytes()
            == cpp.build_sample_idx_int32(*args).tobytes()
        )


def test_blending_byte_identical_to_cpp(cpp):
    for weights, k, size in _random_weights(60, seed=6):
        ours = (np.zeros(size, np.int16), np.zeros(size, np.int64))
        theirs = (np.zeros(size, np.int16), np.zeros(size, np.int64))
        nh.build_blending_indices(*ours, weights, k, size, False)
        cpp.build_blending_indices(*theirs, weights, k, size, False)
        assert ours[0].tobytes() == theirs[0].tobytes()
        assert ours[1].tobytes() == theirs[1].tobytes()


def test_exhaustive_blending_byte_identical_to_cpp(cpp):
    rng = np.random.default_rng(7)
    cases = [[100, 100], [7, 7, 7], [5, 10, 5]]
    cases += [
        [int(s) for s in rng.integers(1, 2000, size=int(rng.integers(1, 7)))] for _ in range(60)
    ]
    for sizes in cases:
        ours = (np.zeros(sum(sizes), np.int16), np.zeros(sum(sizes), np.int64))
        theirs = (np.zeros(sum(sizes), np.int16), np.zeros(sum(sizes), np.int64))
        nh.build_exhaustive_blending_indices(*ours, sizes, len(sizes))
        cpp.build_exhaustive_blending_indices(*theirs, sizes, len(sizes))
        assert ours[0].tobytes() == theirs[0].tobytes()
        assert ours[1].tobytes() == theirs[1].tobytes()


# -- installation ----------------------------------------------------------------------------------


def test_install_and_restore_swap_exactly_the_helper_attributes():
    from megatron.core.datasets import helpers

    names = ["build_sample_idx", "build_blending_indices", "build_exhaustive_blending_indices"]
    originals = {name: getattr(helpers, name) for name in names}
    assert not nh.numpy_helpers_installed()
    try:
        assert nh.install_numpy_helpers() is True
        assert nh.install_numpy_helpers() is False  # idempotent
        for name in names:
            assert getattr(helpers, name) is getattr(nh, name)
        for target, replacement in nh.PATCH_TARGETS.items():
            module, _, attr = target.rpartition(".")
            assert getattr(importlib.import_module(module), attr) is replacement
        with nh.numpy_helpers():  # already installed: must not restore on exit
            pass
        assert nh.numpy_helpers_installed()
    finally:
        nh.restore_helpers()
    for name in names:
        assert getattr(helpers, name) is originals[name]
    with nh.numpy_helpers():
        assert nh.numpy_helpers_installed()
    assert helpers.build_sample_idx is originals["build_sample_idx"]


def test_stand_in_module_when_compiled_helpers_are_missing(monkeypatch):
    import megatron.core.datasets as pkg

    real = sys.modules["megatron.core.datasets.helpers"]
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers", None)  # import fails
    monkeypatch.delattr(pkg, "helpers", raising=False)
    with pytest.raises(ImportError):
        importlib.import_module("megatron.core.datasets.helpers")
    try:
        assert nh.install_numpy_helpers()
        from megatron.core.datasets import helpers

        assert helpers is not real and helpers.build_sample_idx is nh.build_sample_idx
        with pytest.raises(NotImplementedError, match="build_mapping"):
            helpers.build_mapping()
    finally:
        nh.restore_helpers()
    assert sys.modules["megatron.core.datasets.helpers"] is None  # the state found, restored
    assert not hasattr(pkg, "helpers")
