"""LayerNorm / RMSNorm for Megatron's local spec on NPU and CPU.

Megatron's ``WrappedTorchNorm`` (the local spec's norm when apex is absent) refuses sequence
parallelism, and apex's ``FusedLayerNorm`` is CUDA-only. :class:`Norm` keeps torch's parameter
names (``weight``, ``bias``) so checkpoints stay interchangeable, marks its parameters
``sequence_parallel`` so ``finalize_model_grads`` all-reduces their gradients across the
tensor-parallel group, supports zero-centred gamma, and computes through the op layer (the NPU
kernel on an NPU, native torch elsewhere).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_npu.ops import norm as norm_ops


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
) -> torch.Tensor:
    """LayerNorm or RMSNorm of ``x`` over its last dim through the op layer (the NPU kernel on
    an NPU), ``weight`` read as ``1 + weight`` when ``zero_centered_gamma``."""
    if zero_centered_gamma:
        # 1 + w in fp32: in a 16-bit parameter dtype the sum would be rounded once more
        # (bf16 step 2**-7 near 1), an error the stored w does not have
        weight = weight.float() + 1
    if normalization == "RMSNorm":
        return norm_ops.rms_norm(x, weight, eps)[0]
    # fp16/bf16: normalise in fp32 so the weight/bias gradients are summed over tokens in
    # fp32 (torch's CPU kernel sums them in the half type; NPU kernels accumulate in fp32).
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    bias = bias.to(compute) if bias is not None else None
    y = norm_ops.layer_norm(x.to(compute), weight.to(compute), bias, eps)[0]
    return y.to(x.dtype)


class Norm(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be LayerNorm or RMSNorm, got {normalization!r}")
        self.normalization = normalization
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.hidden_size = hidden_size
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=params_dtype))
        if normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(
            x, self.weight, self.bias, self.normalization, self.eps, self.zero_centered_gamma
        )

    def extra_repr(self) -> str:
        return f"{self.normalization}({self.hidden_size}, eps={self.eps})"


def from_megatron_config(config: Any, hidden_size: int, eps: float) -> Norm:
    return Norm(
        hidden_size,
        eps=eps,
        normalization=config.normalization,
        zero_centered_gamma=getattr(config, "layernorm_zero_centered_gamma", False),
        sequence_parallel=config.sequence_parallel,
        params_dtype=config.params_dtype,
    )
