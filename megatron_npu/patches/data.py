"""GPT dataset index building (the seeds' ``_build_index_mappings``) without compiled helpers.

megatron-core builds its sample and blending indices in ``helpers_cpp``, a C++ extension that
``compile_helpers`` must build where no wheel ships it (any machine without a compiler fails).
These entries point ``megatron.core.datasets.helpers`` at numpy implementations that produce
byte-identical arrays (checked against the compiled extension in ``tests/data`` and by the parity
cases). Where the extension is missing entirely, so that the module itself cannot be imported,
:func:`megatron_npu.data.index_helpers.install_numpy_helpers` registers a stand-in module for it
during dataset building.
"""

from __future__ import annotations

from megatron_npu.data import index_helpers
from megatron_npu.registry import Patch

_HELPERS = "megatron.core.datasets.helpers"

PATCHES = [
    Patch(
        id="data.build-sample-idx",
        target=f"{_HELPERS}.build_sample_idx",
        replacement=index_helpers.build_sample_idx,
        reason="GPT sample index in numpy: no compiled helpers_cpp needed",
        versions=">=0.13",
        parity="parity.cases.data:BUILD_SAMPLE_IDX",
        benchmark="perf.cases.data:BUILD_SAMPLE_IDX",
    ),
    Patch(
        id="data.build-blending-indices",
        target=f"{_HELPERS}.build_blending_indices",
        replacement=index_helpers.build_blending_indices,
        reason="blended-dataset index in numpy: no compiled helpers_cpp needed",
        versions=">=0.13",
        check_signature=False,  # the target is a pybind11 builtin
        parity="parity.cases.data:BUILD_BLENDING_INDICES",
        benchmark="perf.cases.data:BUILD_BLENDING_INDICES",
    ),
    Patch(
        id="data.build-exhaustive-blending-indices",
        target=f"{_HELPERS}.build_exhaustive_blending_indices",
        replacement=index_helpers.build_exhaustive_blending_indices,
        reason="exhaustive blended-dataset index in numpy: no compiled helpers_cpp needed",
        versions=">=0.13",
        check_signature=False,
        parity="parity.cases.data:BUILD_EXHAUSTIVE_BLENDING_INDICES",
        benchmark="perf.cases.data:BUILD_EXHAUSTIVE_BLENDING_INDICES",
    ),
]
