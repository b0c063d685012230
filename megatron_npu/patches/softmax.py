"""Megatron's fused scaled-masked softmax -> the op layer (``npu_scaled_masked_softmax``).

``is_kernel_available`` gets the NPU kernel's rule instead of the CUDA kernel's (see
:func:`megatron_npu.ops.softmax.is_fused_softmax_available`); ``forward_fused_softmax`` calls the
op, which builds the causal mask itself for causal attention.
"""

from __future__ import annotations

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


PATCHES = [
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
