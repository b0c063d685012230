"""megatron-npu: run NVIDIA Megatron-Core on Huawei Ascend NPUs (and on CPU for CI).

>>> import megatron_npu
>>> megatron_npu.apply("cpu")      # or "npu", "npu-emulated", "cuda"; None auto-detects
>>> ...                            # build and train Megatron-Core models as usual
>>> megatron_npu.restore()         # put back every original Megatron object
"""

from megatron_npu.patcher import (
    PatchError,
    PatchSignatureError,
    PatchTargetError,
    active_device,
    apply,
    restore,
)

__version__ = "0.1.0"

__all__ = [
    "PatchError",
    "PatchSignatureError",
    "PatchTargetError",
    "__version__",
    "active_device",
    "apply",
    "restore",
]
