"""Algorithm fallbacks are named and recorded, never silent.

When the op layer cannot run the kernel it means to (a fused kernel missing for this device and
dtype) and runs another algorithm instead, it calls :func:`record`: the first time for each
(op, kernel, where) a :class:`FusedKernelFallbackWarning` says what runs instead, and the entry
stays in :func:`recorded`, which ``megatron-npu info`` shows.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import asdict, dataclass
from typing import Any


class FusedKernelFallbackWarning(RuntimeWarning):
    """A fused kernel is unavailable here; a different (slower) algorithm runs instead."""


@dataclass(frozen=True)
class Fallback:
    op: str  #: the op layer function, e.g. ``adamw_step_``
    kernel: str  #: the kernel it could not use, e.g. ``torch._fused_adamw_``
    where: str  #: device and dtypes, e.g. ``cpu float32 params, bfloat16 grads``
    instead: str  #: what runs instead
    reason: str  #: the kernel's own error

    def describe(self) -> str:
        return (
            f"{self.op}: {self.kernel} unavailable for {self.where} ({self.reason}); "
            f"running {self.instead} instead"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "description": self.describe()}


_recorded: dict[tuple[str, str, str], Fallback] = {}
_lock = threading.Lock()


def record(fallback: Fallback) -> None:
    """Record ``fallback``; warn (once per op, kernel and place) the first time it is seen."""
    key = (fallback.op, fallback.kernel, fallback.where)
    with _lock:
        if key in _recorded:
            return
        _recorded[key] = fallback
    warnings.warn(fallback.describe(), FusedKernelFallbackWarning, stacklevel=3)


def recorded() -> list[Fallback]:
    """Every fallback this process has taken, in the order first seen."""
    with _lock:
        return list(_recorded.values())
