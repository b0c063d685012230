"""Megatron's fused scaled-masked softmax -> the op layer (``npu_scaled_masked_softmax``).

``is_kernel_available`` gets the NPU kernel's rule instead of the CUDA kernel's (see
:func:`megatron_npu.ops.softmax.is_fused_softmax_available`); ``forward_fused_softmax`` calls the
op, which builds the causal mask itself for causal attention.

On ``cuda`` Megatron's own kernels stay, where they are installed: they are the CUDA extensions
``scaled_upper_triang_masked_softmax_cuda`` / ``scaled_masked_softmax_cuda`` /
``scaled_softmax_cuda`` that apex or a Megatron-LM source build compiles, and pip's megatron-core
ships none of them. Megatron still picks its fused path for 16-bit scores (masked-softmax fusion is
on by default) and stops at the missing import. ``softmax.cuda-kernel-missing`` makes
``is_kernel_available`` answer no where the extension the call would import is missing, so
Megatron's own torch softmax serves (``--no-masked-softmax-fusion``'s path, the same
arithmetic), and one line says so.
"""

from __future__ import annotations

import functools
import importlib.util

from megatron_npu import console
from megatron_npu.devices.facts import CUDA
from megatron_npu.ops import softmax as softmax_ops
from megatron_npu.registry import Patch

_CLASS = "megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax"


def is_kernel_available(self, mask, b, np, sq, sk):
    dtype = None
    if self.input_in_fp16:
        dtype = softmax_ops.torch.float16
    elif self.input_in_bf16:
        dtype = softmax_ops.torch.bfloat16
    if dtype is None or getattr(self, "window_size", None) is not None:
        return False
    return softmax_ops.is_fused_softmax_available(
        dtype, b, np, sq, sk, fusion_enabled=bool(self.scaled_masked_softmax_fusion)
    )


def forward_fused_softmax(self, input, mask):
    from megatron.core.transformer.enums import AttnMaskType

    scale = self.scale if self.scale is not None else 1.0
    causal = self.attn_mask_type == AttnMaskType.causal
    return softmax_ops.scaled_masked_softmax(
        input, None if causal else mask, scale=scale, causal=causal
    )


def cuda_softmax_extension(causal: bool, masked: bool) -> str:
    """The CUDA extension Megatron's ``forward_fused_softmax`` imports for such a call."""
    if causal:
        return "scaled_upper_triang_masked_softmax_cuda"
    return "scaled_masked_softmax_cuda" if masked else "scaled_softmax_cuda"


@functools.cache
def _say_missing(extension: str) -> None:
    """One line per process and extension: the torch softmax serves."""
    console.warn(
        f"megatron-npu: masked-softmax fusion: Megatron's CUDA extension {extension} is not "
        "installed; its torch softmax serves (the --no-masked-softmax-fusion path)"
    )


def _missing(extension: str) -> bool:
    """False, after saying (once) that the torch softmax serves."""
    _say_missing(extension)
    return False


def _only_with_the_extension(original):
    @functools.wraps(original)
    def is_kernel_available(self, mask, b, np, sq, sk):
        try:
            available = original(self, mask, b, np, sq, sk)
        except ImportError as exc:  # its batch-per-block rule asks scaled_masked_softmax_cuda
            return _missing(exc.name or "scaled_masked_softmax_cuda")
        if not available:
            return False
        from megatron.core.transformer.enums import AttnMaskType

        causal = self.attn_mask_type == AttnMaskType.causal
        extension = cuda_softmax_extension(causal, mask is not None)
        return importlib.util.find_spec(extension) is not None or _missing(extension)

    return is_kernel_available


PATCHES = [
    Patch(
        id="softmax.cuda-kernel-missing",
        target=f"{_CLASS}.is_kernel_available",
        replacement=_only_with_the_extension,
        kind="wrap",
        devices=frozenset({CUDA}),
        reason="pip's megatron-core has no fused-softmax CUDA extension: Megatron's torch softmax "
        "serves where the extension is missing, said in one line, instead of an import error",
        versions=">=0.13",
        benchmark_exempt="a predicate: it picks Megatron's own torch softmax, timed within "
        "softmax.fused's benchmark (path megatron)",
        parity_exempt="picks Megatron's own unfused softmax, no numerics of its own",
        exempt_test="tests/patches/test_softmax_cuda_kernel.py::"
        "test_missing_extension_is_one_line_and_the_torch_softmax",
    ),
    Patch(
        id="softmax.is-kernel-available",
        target=f"{_CLASS}.is_kernel_available",
        replacement=is_kernel_available,
        reason="the NPU kernel's shape rule (32..4096, multiple of 32; fp16/bf16) replaces CUDA's",
        versions=">=0.13",
        benchmark_exempt="a shape predicate evaluated once per layer call; timed within "
        "softmax.fused's benchmark",
        parity_exempt="a shape predicate, no numerics: the named test checks it against the "
        "kernel's documented limits; its numerics are softmax.fused",
        exempt_test="tests/patches/test_softmax_rule.py::test_cuda_only_conditions_are_dropped",
    ),
    Patch(
        id="softmax.fused",
        target=f"{_CLASS}.forward_fused_softmax",
        replacement=forward_fused_softmax,
        reason="CUDA-only scaled_(upper_triang_)masked_softmax kernels -> the op layer",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.softmax:FUSED_SOFTMAX",
        benchmark="perf.cases.layers:FUSED_SOFTMAX",
        npu_kernels=("npu_scaled_masked_softmax",),
    ),
]
