"""megatron-npu: run NVIDIA Megatron-Core on Huawei Ascend NPUs (and on CPU for CI).

>>> import megatron_npu
>>> megatron_npu.apply("cpu")      # or "npu", "npu-emulated", "cuda"; None auto-detects
>>> ...                            # build and train Megatron-Core models as usual
>>> megatron_npu.restore()         # put back every original Megatron object

``MEGATRON_NPU_DISABLE=id1,id2`` (or ``apply(device, disable=("id1",))``, or ``--disable-patch ID``
on the command line) leaves those registry patches out; ``megatron-npu info`` reports them.
"""

import importlib.metadata

from megatron_npu import import_warnings

import_warnings.quiet()

from megatron_npu.disable_patch_option import add_disable_patch_argument  # noqa: E402
from megatron_npu.patcher import (  # noqa: E402  (the filter first: anything may import megatron)
    PatchError,
    PatchSignatureError,
    PatchTargetError,
    UnknownPatchError,
    active_device,
    apply,
    restore,
)

try:  # pyproject.toml holds the version; the installed metadata carries it
    __version__ = importlib.metadata.version("megatron-npu")
except importlib.metadata.PackageNotFoundError:  # imported from a checkout that is not installed
    __version__ = "0+unknown"

__all__ = [
    "PatchError",
    "PatchSignatureError",
    "PatchTargetError",
    "UnknownPatchError",
    "__version__",
    "active_device",
    "add_disable_patch_argument",
    "apply",
    "restore",
]
