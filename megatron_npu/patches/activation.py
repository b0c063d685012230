"""Megatron's fused bias-activation functions -> the op layer (``npu_swiglu`` on the NPU)."""

from __future__ import annotations

from megatron_npu.ops.gelu import bias_gelu
from megatron_npu.ops.swiglu import bias_swiglu
from megatron_npu.registry import Patch


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """silu(first half of input+bias) * second half, over the last dim (Megatron's order)."""
    if fp8_input_store or cpu_offload_input:
        raise ValueError(
            "bias_swiglu_impl: fp8_input_store / cpu_offload_input are CUDA memory options the "
            "NPU path does not implement; turn them off"
        )
    return bias_swiglu(input, bias, dim=-1)


def bias_gelu_impl(input, bias):
    """GELU(input + bias) with the tanh approximation Megatron's fused bias-GELU uses."""
    return bias_gelu(input, bias, approximate="tanh")


PATCHES = [
    Patch(
        id="activation.bias-swiglu",
        target="megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl",
        replacement=bias_swiglu_impl,
        reason="route --swiglu's fused bias-SwiGLU to npu_swiglu / the native op",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.activation:BIAS_SWIGLU",
        benchmark="perf.cases.layers:BIAS_SWIGLU",
        npu_kernels=("npu_swiglu",),
    ),
    Patch(
        id="activation.bias-gelu",
        target="megatron.core.fusions.fused_bias_gelu.bias_gelu_impl",
        replacement=bias_gelu_impl,
        reason="jit-scripted CUDA bias-GELU -> the op layer",
        versions=">=0.13",
        check_signature=False,  # the target is an autograd Function's apply (no signature)
        parity="megatron_npu.parity.cases.activation:BIAS_GELU",
        benchmark="perf.cases.layers:BIAS_GELU",
        npu_kernels=("npu_gelu",),
    ),
]
