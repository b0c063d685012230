"""Small input checks shared by the op modules.

Every op validates its inputs the same way on every device, so a call that would be rejected by
the NPU kernel is rejected on CPU too. Errors name the op and the broken constraint.
"""

from __future__ import annotations

import torch

#: dtypes the NPU fused kernels accept (fp64 is not supported on the NPU).
KERNEL_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_float_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    """Raise TypeError unless ``tensor`` is float16, bfloat16 or float32."""
    if tensor.dtype not in KERNEL_FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} dtype must be one of float16, bfloat16, float32, "
            f"got {dtype_name(tensor.dtype)}"
        )


def check_same_dtype(op: str, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(f"{n}={dtype_name(t.dtype)}" for n, t in zip(names, tensors, strict=True))
        raise TypeError(f"{op}: {', '.join(names)} must share one dtype, got {got}")


def broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if ``shape`` broadcasts to ``target`` without changing ``target``."""
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target), strict=False):
        if s not in (1, t):
            return False
    return True
