"""Megatron's gradient-accumulation fusion (``--gradient-accumulation-fusion``, on by default in
Megatron-LM) without apex's CUDA extension.

The tensor-parallel linear layers refuse to build when the fusion is asked for and
``fused_weight_gradient_mlp_cuda`` did not import; their backward then calls
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16`` to add the weight gradient straight
into ``weight.main_grad``. The entries make the extension "available" and install
:data:`megatron_npu.ops.wgrad_accum.FUSED_WEIGHT_GRADIENT_MLP` under that name (created when apex
is absent, removed again by ``restore()``).
"""

from __future__ import annotations

from megatron_npu.ops.wgrad_accum import FUSED_WEIGHT_GRADIENT_MLP
from megatron_npu.registry import Patch

_LAYERS = "megatron.core.tensor_parallel.layers"

PATCHES = [
    Patch(
        id="grad-accum-fusion.kernel",
        target=f"{_LAYERS}.fused_weight_gradient_mlp_cuda",
        replacement=FUSED_WEIGHT_GRADIENT_MLP,
        creates=True,
        reason="apex's CUDA wgrad GEMM-accumulate -> the op layer (fp32 accumulation into "
        "main_grad)",
        parity="megatron_npu.parity.cases.wgrad_accum:GRADIENT_ACCUMULATION_FUSION",
        benchmark="perf.cases.wgrad_accum:GRADIENT_ACCUMULATION_FUSION",
    ),
    Patch(
        id="grad-accum-fusion.available",
        target=f"{_LAYERS}._grad_accum_fusion_available",
        replacement=True,
        reason="the linear layers accept gradient_accumulation_fusion: the kernel above serves it",
        parity_exempt="a flag that lets the layers use the kernel, which has its own parity case",
        exempt_test="tests/ops/test_wgrad_accum.py::test_linear_layer_accumulates_into_main_grad",
        benchmark_exempt="a module flag read when a layer is built",
    ),
]
