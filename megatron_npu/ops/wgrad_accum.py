"""Weight-gradient accumulation into ``main_grad``: the contract of Megatron's
``fused_weight_gradient_mlp_cuda`` extension (``--gradient-accumulation-fusion``, on by default in
Megatron-LM).

``wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)`` adds ``grad_output^T @
total_input`` (``[out, n] @ [n, in]``) to an fp32 ``main_grad`` in place; the GEMM accumulates in
fp32 whatever the inputs' dtype (16-bit products are exact in fp32), as the CUDA kernel does.
``wgrad_gemm_accum_fp16`` does the same for a 16-bit ``main_grad``: the sum is formed in fp32 and
rounded once into ``main_grad``. Plain torch, so one code path serves cpu, npu-emulated and npu
(torch_npu's matmul with the fp32 upcast is what MindSpeed's own fallback runs).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

_HALF = (torch.float16, torch.bfloat16)


def _check(name: str, total_input: torch.Tensor, grad_output: torch.Tensor, main_grad) -> None:
    if total_input.dim() != 2 or grad_output.dim() != 2:
        raise ValueError(
            f"{name}: total_input and grad_output must be 2-D [tokens, features], got "
            f"{tuple(total_input.shape)} and {tuple(grad_output.shape)}"
        )
    want = (grad_output.shape[1], total_input.shape[1])
    if total_input.shape[0] != grad_output.shape[0] or tuple(main_grad.shape) != want:
        raise ValueError(
            f"{name}: shapes do not chain: total_input {tuple(total_input.shape)}, grad_output "
            f"{tuple(grad_output.shape)}, main_grad {tuple(main_grad.shape)} (want {want})"
        )


def _wgrad_fp32(total_input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    return grad_output.t().to(torch.float32) @ total_input.to(torch.float32)


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    _check("wgrad_gemm_accum_fp32", total_input, grad_output, main_grad)
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32: main_grad must be float32, got {main_grad.dtype}")
    main_grad.add_(_wgrad_fp32(total_input, grad_output))


def wgrad_gemm_accum_fp16(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    _check("wgrad_gemm_accum_fp16", total_input, grad_output, main_grad)
    if main_grad.dtype not in _HALF:
        raise TypeError(
            f"wgrad_gemm_accum_fp16: main_grad must be float16 or bfloat16, got {main_grad.dtype}"
        )
    main_grad.copy_(main_grad.to(torch.float32) + _wgrad_fp32(total_input, grad_output))


#: stands in for the ``fused_weight_gradient_mlp_cuda`` module Megatron imports
FUSED_WEIGHT_GRADIENT_MLP = SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16
)
