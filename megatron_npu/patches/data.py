"""GPT dataset index building (``_build_index_mappings``) without compiled helpers.

megatron-core builds its sample and blending indices in ``helpers_cpp``, a C++ extension that
``compile_helpers`` must build where no wheel ships it (any machine without a compiler fails).
These entries point ``megatron.core.datasets.helpers`` at numpy implementations that produce
byte-identical arrays (checked against the compiled extension in ``tests/data`` and by the parity
cases).

They apply whether or not ``helpers_cpp`` is compiled: where it is missing, importing
``megatron.core.datasets.helpers`` fails, so :func:`helpers_module` registers a stand-in module
under that name whose functions raise the error Megatron would (that is what ``restore()`` puts
back), and the patches replace them as usual. ``compile_helpers()`` (which runs ``make`` on a
Makefile the wheel does not ship) becomes a no-op.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
import types

from megatron_npu import console
from megatron_npu.data import index_helpers
from megatron_npu.devices.facts import CUDA
from megatron_npu.registry import Patch

_HELPERS = "megatron.core.datasets.helpers"
#: every function megatron-core's ``helpers`` module offers (the compiled ones and the wrapper)
_HELPER_NAMES = (
    "build_sample_idx",
    "build_sample_idx_int32",
    "build_sample_idx_int64",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "build_mapping",
    "build_blocks_mapping",
)
_logger = logging.getLogger(__name__)


def _uncompiled(name: str, error: ImportError):
    def helper(*args, **kwargs):
        raise ImportError(
            f"{_HELPERS}.{name} needs megatron-core's compiled helpers_cpp, which is missing "
            f"({error}); megatron_npu.apply() replaces the GPT index helpers with numpy"
        )

    helper.__name__ = helper.__qualname__ = name
    numpy_version = index_helpers.PATCH_TARGETS.get(f"{_HELPERS}.{name}")
    if numpy_version is not None:  # megatron's signature, which the numpy version matches
        helper.__signature__ = inspect.signature(numpy_version)
    return helper


def helpers_module() -> types.ModuleType | None:
    """``megatron.core.datasets.helpers``, or where ``helpers_cpp`` is not compiled a stand-in
    registered under its name (None when megatron-core's datasets are not installed at all)."""
    try:
        return importlib.import_module(_HELPERS)
    except ImportError as error:
        try:
            package = importlib.import_module("megatron.core.datasets")
        except ImportError:
            return None
        stand_in = types.ModuleType(_HELPERS, "stand-in: helpers_cpp is not compiled here")
        for name in _HELPER_NAMES:
            setattr(stand_in, name, _uncompiled(name, error))
        sys.modules[_HELPERS] = stand_in
        package.helpers = stand_in
        return stand_in


def _wrap_mock_getitem(original):
    """megatron-core 0.16's mock sample: token ids wrap modulo the tokenizer's vocabulary."""

    @functools.wraps(original)
    def __getitem__(self, idx):
        sample = original(self, idx)
        sample[:-1] %= self.tokenizer.vocab_size  # the last id is the end-of-document token
        return sample

    return __getitem__


def compile_helpers() -> None:
    """Nothing to compile: the GPT index helpers are numpy
    (:mod:`megatron_npu.data.index_helpers`)."""
    _logger.info("megatron-npu: dataset index helpers are numpy; nothing to compile")


def _compile_where_possible(original):
    """On ``cuda``, Megatron's own ``compile_helpers`` wherever it can build; where it cannot (an
    installed wheel ships no Makefile: ``make`` stops and Megatron exits), nothing is run and one
    line says what serves instead: the wheel's prebuilt ``helpers_cpp``, or, where that is
    missing too, the adaptor's byte-identical numpy helpers
    (:func:`megatron_npu.data.index_helpers.install_numpy_helpers`)."""

    @functools.wraps(original)
    def compile_helpers():
        folder = os.path.dirname(os.path.abspath(inspect.getfile(original)))
        if os.path.isfile(os.path.join(folder, "Makefile")):
            return original()
        built = importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
        if not built:
            index_helpers.install_numpy_helpers()
        serving = (
            "its prebuilt helpers_cpp serves"
            if built
            else "the adaptor's numpy index helpers serve (byte-identical)"
        )
        console.warn(
            f"megatron-npu: megatron-core's dataset helpers cannot be built here (no Makefile in "
            f"{folder}): {serving}"
        )

    return compile_helpers


helpers_module()

PATCHES = [
    Patch(
        id="data.mock-token-ids-in-vocab",
        target="megatron.core.datasets.gpt_dataset.MockGPTLowLevelDataset.__getitem__",
        replacement=_wrap_mock_getitem,
        kind="wrap",
        reason="0.13-0.15 mock samples count up to 4095 whatever the vocab (embedding index "
        "error): backport of 0.16's modulo-vocab ids",
        versions="<0.16",
        parity_exempt="backport of megatron-core 0.16's own mock-data formula, no device numerics",
        exempt_test="tests/patches/test_mock_data.py::test_mock_samples_stay_inside_the_vocab",
        benchmark_exempt="one modulo per mock sample, data plumbing",
    ),
    Patch(
        id="data.compile-helpers",
        target="megatron.core.datasets.utils.compile_helpers",
        replacement=compile_helpers,
        reason="no make/Makefile/compiler needed: the index helpers are numpy",
        versions=">=0.13",
        parity_exempt="build step, no numerics: the helpers it stands for have parity cases",
        exempt_test="tests/test_patcher.py::test_compile_helpers_needs_no_make",
        benchmark_exempt="a build step run once, not a per-step cost",
    ),
    Patch(
        id="data.compile-helpers-cuda",
        target="megatron.core.datasets.utils.compile_helpers",
        replacement=_compile_where_possible,
        kind="wrap",
        devices=frozenset({CUDA}),
        reason="pip's megatron-core ships no Makefile: Megatron-LM's compile_helpers exits; build "
        "where it can, else the prebuilt or numpy helpers serve, said in one line",
        versions=">=0.13",
        parity_exempt="build step, no numerics: the helpers it may stand for have parity cases",
        exempt_test="tests/patches/test_compile_helpers_cuda.py::test_no_makefile_is_one_line_not_an_exit",
        benchmark_exempt="a build step run once, not a per-step cost",
    ),
    Patch(
        id="data.build-sample-idx",
        target=f"{_HELPERS}.build_sample_idx",
        replacement=index_helpers.build_sample_idx,
        reason="GPT sample index in numpy: no compiled helpers_cpp needed",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.data:BUILD_SAMPLE_IDX",
        benchmark="perf.cases.data:BUILD_SAMPLE_IDX",
    ),
    Patch(
        id="data.build-blending-indices",
        target=f"{_HELPERS}.build_blending_indices",
        replacement=index_helpers.build_blending_indices,
        reason="blended-dataset index in numpy: no compiled helpers_cpp needed",
        versions=">=0.13",
        check_signature=False,  # the target is a pybind11 builtin
        parity="megatron_npu.parity.cases.data:BUILD_BLENDING_INDICES",
        benchmark="perf.cases.data:BUILD_BLENDING_INDICES",
    ),
    Patch(
        id="data.build-exhaustive-blending-indices",
        target=f"{_HELPERS}.build_exhaustive_blending_indices",
        replacement=index_helpers.build_exhaustive_blending_indices,
        reason="exhaustive blended-dataset index in numpy: no compiled helpers_cpp needed",
        versions=">=0.13",
        check_signature=False,
        parity="megatron_npu.parity.cases.data:BUILD_EXHAUSTIVE_BLENDING_INDICES",
        benchmark="perf.cases.data:BUILD_EXHAUSTIVE_BLENDING_INDICES",
    ),
]
