"""The C++ band-attention forward for CPU (``csrc/band_attention.cpp``): build, load, call.

Windowed attention on CPU is assembled from ATen's flash kernel otherwise (see
:mod:`megatron_npu.ops.attention`), and that kernel computes whole 256 x 512 tiles, so a band
costs about 512 masked scores per query row on top of the ``window + 1`` it needs: the
sliding window of 2048 at S=8192 then runs only ~1.9x faster than full causal attention where
the work allows ~2.3x. The C++ forward computes only the keys each block of rows can see.

It is compiled on first use with :func:`torch.utils.cpp_extension.load` (needs ``ninja``, a
C++ compiler and torch's headers; about 20 s once, then cached under torch's extension
directory, ``TORCH_EXTENSIONS_DIR``). Where it cannot be built or loaded the attention code
keeps the flash-piece path and :func:`status` says why. ``MEGATRON_NPU_CPU_KERNEL=0`` turns it
off (``megatron-npu info`` shows which is in use).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

#: environment switch: ``0`` keeps windowed attention on the ATen flash pieces.
ENV_VAR = "MEGATRON_NPU_CPU_KERNEL"
SOURCE = Path(__file__).with_name("csrc") / "band_attention.cpp"
_LIBRARY = "megatron_npu_cpu"

_COMPILE_FLAGS = {  # torch's CPU capability -> the same vector ISA for ATen's Vectorized<float>
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}


@dataclass(frozen=True)
class KernelStatus:
    """Whether the C++ forward is in use, and if not, why."""

    available: bool
    reason: str

    def describe(self) -> str:
        return "C++ band kernel" if self.available else f"ATen flash pieces ({self.reason})"


_lock = threading.Lock()
_status: KernelStatus | None = None


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "no", "off")


def _build() -> KernelStatus:
    # loaded already (a status reset in tests): registering the library twice would fail
    if not hasattr(getattr(torch.ops, _LIBRARY), "band_attention_forward"):
        from torch.utils import cpp_extension

        capability = torch.backends.cpu.get_cpu_capability()
        flags = _COMPILE_FLAGS.get(capability, ["-DCPU_CAPABILITY=DEFAULT"])
        cpp_extension.load(
            name=f"megatron_npu_band_attention_{capability.lower()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    return KernelStatus(True, "built")


def status() -> KernelStatus:
    """Build and load the kernel once per process (unless switched off) and say if it is usable."""
    global _status
    if not enabled_by_environment():
        return KernelStatus(False, f"{ENV_VAR}=0")
    if _status is None:
        with _lock:
            if _status is None:
                try:
                    _status = _build()
                except Exception as exc:  # no compiler, no ninja, no sgemm_ symbol, ...
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    _status = KernelStatus(False, f"not built: {type(exc).__name__}: {first}")
    return _status


def band_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo: int, hi: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)`` of attention where query row ``i`` sees keys ``[i + lo, i + hi]``, for
    (BN, S, D) fp32 CPU tensors; None when the kernel is not available (use the pieces)."""
    if not status().available:
        return None
    return torch.ops.megatron_npu_cpu.band_attention_forward(query, key, value, lo, hi, scale)
