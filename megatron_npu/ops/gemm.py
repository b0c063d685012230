"""Transformer Engine's ``general_gemm`` contract on plain matmuls.

megatron-core's MoE router computes its gating logits through ``te_general_gemm`` whenever TE's
extension module imported (``moe_utils.RouterGatingLinearFunction``): a GEMM whose inputs are in
the model's dtype and whose output is in the router's dtype (fp32 by default). ``layout`` names
how each operand enters the product, TE's column-major convention read row-major:

* ``"TN"``: ``B @ A.T`` (the forward: ``A`` is the weight, ``B`` the tokens)
* ``"NN"``: ``B @ A``   (the input gradient)
* ``"NT"``: ``B.T @ A`` (the weight gradient)

The operands are cast to ``out_dtype`` first, as Megatron's own fallback does, so the product
accumulates in the router dtype on every device (one matmul, the NPU's cube unit on the NPU).
"""

from __future__ import annotations

import torch

_LAYOUTS = ("TN", "NN", "NT")


def _operand(t: torch.Tensor, letter: str) -> torch.Tensor:
    """One operand as it enters the product: transposed for ``"T"``."""
    return t.t() if letter == "T" else t


def general_gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    layout: str = "TN",
    bias: torch.Tensor | None = None,
    grad: bool = False,
) -> list[torch.Tensor | None]:
    """``op_B(B) @ op_A(A) (+ bias)`` in ``out_dtype``; TE's return shape ``[out, bias_grad,
    gelu_input, extra_output]`` (the last three are None: no epilogue is fused)."""
    if layout not in _LAYOUTS:
        raise ValueError(
            f"general_gemm: layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}"
        )
    if A.dim() != 2 or B.dim() != 2:
        raise ValueError(
            f"general_gemm: A and B must be 2-D, got {tuple(A.shape)} and {tuple(B.shape)}"
        )
    dtype = out_dtype or B.dtype
    a = A.to(dtype)
    b = B.to(dtype)
    op_a = _operand(a, layout[0])
    op_b = _operand(b, layout[1])
    if op_b.shape[1] != op_a.shape[0]:
        raise ValueError(
            f"general_gemm: layout {layout} multiplies {tuple(op_b.shape)} by {tuple(op_a.shape)}"
        )
    if bias is None or grad:
        out = torch.mm(op_b, op_a)
    else:
        out = torch.addmm(bias.to(dtype), op_b, op_a)
    return [out, None, None, None]
