"""Per-layer fused ops at GPT sizes (sequence 2048, batch 1, hidden 4096, FFN 2 x 8192):
bias-SwiGLU, bias-GELU, RMSNorm, rotary embedding (32 heads x 128) and the scaled-masked softmax
(16 heads, 2048 x 2048 scores, 16-bit: the NPU kernel takes fp16/bf16 only).

``megatron`` runs Megatron's own functions: its ``jit_fuser`` (``torch.compile``) functions run
eagerly, as on any machine where compiling for the CPU is not wanted; the softmax is Megatron's
``forward_torch_softmax``, its path when the CUDA kernel is unavailable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from perf.case import BenchCase, Built, Cell, implementation

_GEN_SEED = 0


def _randn(cell: Cell, *shape: int, grad: bool = True, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_GEN_SEED)
    t = (torch.randn(*shape, generator=gen) * scale).to(cell.torch_dtype)
    return t.requires_grad_(grad)


def _eager(fn: Callable) -> Callable:
    def run(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return fn(*args, **kwargs)

    return run


def _bias_act(cell: Cell) -> Built:
    s, b, h = (cell.shape[k] for k in ("seq", "batch", "width"))
    x, bias = _randn(cell, s, b, h), _randn(cell, h)
    fn = _eager(implementation(cell))
    return Built(lambda: fn(x, bias), (x, bias))


def _norm(cell: Cell) -> Built:
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, b, h = (cell.shape[k] for k in ("seq", "batch", "hidden"))
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1,
                               normalization="RMSNorm", use_cpu_initialization=True)  # fmt: skip
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    new = implementation(cell)
    module = new(WrappedTorchNorm, config, h, eps=1e-5).to(cell.torch_dtype)
    x = _randn(cell, s, b, h)
    return Built(lambda: module(x), (x, *module.parameters()))


def _rotary(cell: Cell) -> Built:
    s, b, n, d = (cell.shape[k] for k in ("seq", "batch", "heads", "head_dim"))
    t = _randn(cell, s, b, n, d)
    freqs = torch.randn(s, 1, 1, d, generator=torch.Generator().manual_seed(1))
    fn = implementation(cell)
    return Built(lambda: fn(t, freqs), (t,))


def _softmax(cell: Cell) -> Built:
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    b, n, s = (cell.shape[k] for k in ("batch", "heads", "seq"))
    module = FusedScaleMaskSoftmax(
        input_in_fp16=cell.torch_dtype == torch.float16,
        input_in_bf16=cell.torch_dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal, scaled_masked_softmax_fusion=True,
        mask_func=attention_mask_func, softmax_in_fp32=True, scale=None,
    )  # fmt: skip
    scores = _randn(cell, b, n, s, s)
    forward = (module.forward_torch_softmax if cell.path == "megatron"
               else lambda x, mask: implementation(cell)(module, x, mask))  # fmt: skip
    # a fresh tensor per call, as the attention scores are (Megatron's mask fills in place)
    return Built(lambda: forward(scores * 1, None), (scores,))


_SEQ = {"full": 2048, "quick": 256}
BIAS_SWIGLU = BenchCase(
    op="bias-swiglu",
    shapes={k: {"seq": s, "batch": 1, "width": 2 * (8192 if k == "full" else 512)}
            for k, s in _SEQ.items()},
    build=_bias_act,
)
BIAS_GELU = BenchCase(
    op="bias-gelu",
    shapes={k: {"seq": s, "batch": 1, "width": 8192 if k == "full" else 512}
            for k, s in _SEQ.items()},
    build=_bias_act,
)
RMS_NORM = BenchCase(
    op="rms-norm",
    shapes={k: {"seq": s, "batch": 1, "hidden": 4096 if k == "full" else 256}
            for k, s in _SEQ.items()},
    build=_norm,
)
ROTARY = BenchCase(
    op="rotary",
    shapes={k: {"seq": s, "batch": 1, "heads": 32 if k == "full" else 4, "head_dim": 128}
            for k, s in _SEQ.items()},
    build=_rotary,
)
FUSED_SOFTMAX = BenchCase(
    op="scaled-masked-softmax",
    shapes={k: {"batch": 1, "heads": 16 if k == "full" else 2, "seq": s}
            for k, s in _SEQ.items()},
    build=_softmax,
    dtypes=("bfloat16", "float16"),
    note="the NPU kernel (and Megatron's CUDA kernel) take fp16/bf16 only",
)
