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
From megatron-core 0.18 the linear layers' backward under Megatron-FSDP calls the extension's own
``te_general_gemm`` as well, with an output buffer (:func:`te_general_gemm`).
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


def te_general_gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    layout: str = "TN",
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    grad: bool = False,
) -> list[torch.Tensor | None]:
    """megatron-core's own ``te_general_gemm`` (``megatron.core.extensions.transformer_engine``,
    0.18+): :func:`general_gemm`, whose product is written into ``out`` when one is given (and is
    then in ``out``'s dtype unless ``out_dtype`` says otherwise). Megatron-FSDP's weight gradient
    comes this way, a 16-bit product kept in the fp32 gradient buffer."""
    if out is None:
        return general_gemm(A, B, out_dtype, layout, bias, grad)
    product = general_gemm(A, B, out_dtype or out.dtype, layout, bias, grad)[0]
    out.copy_(product)
    return [out, None, None, None]
