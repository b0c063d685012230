"""fp16 and bf16 matrix products on the CPU stand-in devices: one fp32 product rounded once.

Megatron's layers multiply through torch: the tensor-parallel linear's forward (``torch.matmul``)
and hand-written backward (``Tensor.matmul``), the unfused attention (``torch.baddbmm``,
``torch.bmm``), the MoE experts (``torch.matmul``, ``torch.mm``) and the adaptor's Transformer
Engine stand-ins (``F.linear``). On ``cpu`` and ``npu-emulated`` each of these serves a 16-bit
product by :func:`megatron_npu.ops.half_matmul.fp32_accumulated`: the arithmetic of the NPU's
matrix unit (fp32 accumulation, one rounding) at fp32's speed instead of PyTorch's scalar 16-bit
fallback. A real NPU multiplies that way natively, and ``cuda`` keeps its own kernels, so neither
installs these entries.
"""

from __future__ import annotations

from megatron_npu.devices.facts import CPU, NPU_EMULATED
from megatron_npu.ops.half_matmul import fp32_accumulated
from megatron_npu.registry import Patch

#: patch id suffix -> the torch product it wraps
TARGETS = {
    "torch-matmul": "torch.matmul",
    "tensor-matmul": "torch.Tensor.matmul",
    "tensor-matmul-operator": "torch.Tensor.__matmul__",
    "torch-mm": "torch.mm",
    "torch-bmm": "torch.bmm",
    "torch-baddbmm": "torch.baddbmm",
    "functional-linear": "torch.nn.functional.linear",
}

PATCHES = [
    Patch(
        id=f"matmul.{name}",
        target=target,
        replacement=fp32_accumulated,
        kind="wrap",
        devices=frozenset({CPU, NPU_EMULATED}),
        check_signature=False,  # torch's builtins carry no Python signature
        reason="fp16/bf16 products as one fp32 product rounded once (the NPU's matrix-unit "
        "arithmetic at fp32's pace on the CPU stand-ins)",
        parity=f"megatron_npu.parity.cases.matmul:{name.upper().replace('-', '_')}",
        benchmark=f"perf.cases.matmul:{name.upper().replace('-', '_')}",
    )
    for name, target in TARGETS.items()
]
