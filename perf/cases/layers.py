"""Per-layer fused ops at GPT sizes (sequence 2048, batch 1, hidden 4096, FFN 2 x 8192):
bias-SwiGLU, bias-GELU, RMSNorm, rotary embedding (32 heads x 128) and the scaled-masked softmax
(16 heads, 2048 x 2048 scores, 16-bit: the NPU kernel takes fp16/bf16 only).

``megatron`` runs Megatron's own functions: its ``jit_fuser`` (``torch.compile``) functions run
eagerly, as on any machine where compiling for the CPU is not wanted; the softmax is Megatron's
``forward_torch_softmax``, its path when the CUDA kernel is unavailable.

The Transformer Engine stand-ins (``TE_*``, :mod:`megatron_npu.modules.te_layers`) replace
placeholders (``MagicMock`` objects, a ``TENorm`` that raises) that cannot run, so
:func:`perf.case.implementation` has nothing to time on their ``megatron`` path. There that path
is the *local-spec* module Megatron builds instead when it has no TE (``--transformer-impl
local``), stock: Megatron's own ``WrappedTorchNorm`` (torch's RMSNorm; built through the norm
patch's recorded original, so not the adaptor's norm), ``ColumnParallelLinear`` and
``RowParallelLinear`` (the local MLA spec's down-projections are column-parallel too, the
counterpart of ``TELinear(parallel_mode="duplicated")``); the input norm of
``TELayerNormColumnParallelLinear`` is that norm followed by ``ColumnParallelLinear``.
``native`` / ``npu-binding`` run the stand-in installed at the TE name. Hidden 1024 (8 heads x
128), sequence 2048, batch 1: the QKV projection (1024 -> 3072), FC1 (1024 -> 4096), FC2
(4096 -> 1024). The GEMM cases run fp32 only: this CPU has no bf16 matrix units (a bf16 GEMM
runs about 100x slower than fp32, see ``perf/README.md``), so a bf16 figure would time the
emulation of bf16 arithmetic, not the layer; the GEMM-free TE_NORM runs both dtypes. The
linears call no NPU kernel (the same code on every device), so they have no ``npu-binding``
path; the ones with the norm do (``npu_rms_norm``).
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
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=1,
        normalization="RMSNorm",
        use_cpu_initialization=True,
    )
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
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=True,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    scores = _randn(cell, b, n, s, s)
    forward = (
        module.forward_torch_softmax
        if cell.path == "megatron"
        else lambda x, mask: implementation(cell)(module, x, mask)
    )
    # a fresh tensor per call, as the attention scores are (Megatron's mask fills in place)
    return Built(lambda: forward(scores * 1, None), (scores,))


_SEQ = {"full": 2048, "quick": 256}
BIAS_SWIGLU = BenchCase(
    op="bias-swiglu",
    shapes={
        k: {"seq": s, "batch": 1, "width": 2 * (8192 if k == "full" else 512)}
        for k, s in _SEQ.items()
    },
    build=_bias_act,
)
BIAS_GELU = BenchCase(
    op="bias-gelu",
    shapes={
        k: {"seq": s, "batch": 1, "width": 8192 if k == "full" else 512} for k, s in _SEQ.items()
    },
    build=_bias_act,
)
RMS_NORM = BenchCase(
    op="rms-norm",
    shapes={
        k: {"seq": s, "batch": 1, "hidden": 4096 if k == "full" else 256} for k, s in _SEQ.items()
    },
    build=_norm,
)
ROTARY = BenchCase(
    op="rotary",
    shapes={
        k: {"seq": s, "batch": 1, "heads": 32 if k == "full" else 4, "head_dim": 128}
        for k, s in _SEQ.items()
    },
    build=_rotary,
)
FUSED_SOFTMAX = BenchCase(
    op="scaled-masked-softmax",
    shapes={k: {"batch": 1, "heads": 16 if k == "full" else 2, "seq": s} for k, s in _SEQ.items()},
    build=_softmax,
    dtypes=("bfloat16", "float16"),
    note="the NPU kernel (and Megatron's CUDA kernel) take fp16/bf16 only",
)


# ------------------------------------------------------------------- Transformer Engine stand-ins


def _stand_in_or_local(cell: Cell, local: Callable) -> Callable:
    """The TE stand-in installed at the cell's patch target, or on the ``megatron`` path the
    builder of the local-spec module (the module docstring says why)."""
    from perf.case import installed_of

    return local if cell.path == "megatron" else installed_of(cell)


def _te_config(cell: Cell, hidden: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        params_dtype=cell.torch_dtype,
    )


def _stock_norm(config, hidden: int, eps: float):
    """Megatron's own WrappedTorchNorm (torch's norm), not the norm patch's replacement."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_npu import patcher
    from megatron_npu.registry import get_patch

    stock_new = patcher.original(get_patch("norm.wrapped-torch-norm"))
    return stock_new(WrappedTorchNorm, config, hidden, eps=eps)


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.02)


def _te_norm(cell: Cell) -> Built:
    s, b, h = (cell.shape[k] for k in ("seq", "batch", "hidden"))
    config = _te_config(cell, h)
    module = _stand_in_or_local(cell, _stock_norm)(config, h, 1e-5).to(cell.torch_dtype)
    x = _randn(cell, s, b, h)
    return Built(lambda: module(x), (x, *module.parameters()))


def _te_linear(kind: str) -> Callable[[Cell], Built]:
    """``layernorm-column`` / ``column`` / ``row`` / ``duplicated``: the stand-in (``(out,
    bias)``) or its local-spec counterpart, bias added inside (Megatron's default)."""

    def build(cell: Cell) -> Built:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        s, b, i, o = (cell.shape[k] for k in ("seq", "batch", "fan_in", "fan_out"))
        config = _te_config(cell, i)
        common = dict(
            config=config, init_method=_init, bias=True, skip_bias_add=False, is_expert=False
        )
        if cell.path == "megatron":
            if kind == "row":
                linear = RowParallelLinear(i, o, input_is_parallel=True, **common)
            else:
                linear = ColumnParallelLinear(i, o, gather_output=False, **common)
            norm = _stock_norm(config, i, 1e-5) if kind == "layernorm-column" else None
            module = torch.nn.Sequential(*(m for m in (norm, linear) if m is not None))

            def forward(x):
                return linear(norm(x) if norm is not None else x)[0]
        else:
            from perf.case import installed_of

            cls = installed_of(cell)
            if kind == "row":
                module = cls(i, o, input_is_parallel=True, **common)
            elif kind == "duplicated":
                module = cls(
                    i, o, parallel_mode="duplicated", skip_weight_param_allocation=False, **common
                )
            else:
                module = cls(i, o, gather_output=False, **common)

            def forward(x):
                return module(x)[0]

        module.to(cell.torch_dtype)
        x = _randn(cell, s, b, i)
        return Built(lambda: forward(x), (x, *module.parameters()))

    return build


_HIDDEN = {"full": 1024, "quick": 256}


def _gemm_shapes(fan_in: Callable[[int], int], fan_out: Callable[[int], int]):
    return {
        k: {"seq": _SEQ[k], "batch": 1, "fan_in": fan_in(h), "fan_out": fan_out(h)}
        for k, h in _HIDDEN.items()
    }


_GEMM_NOTE = "fp32 only: this CPU has no bf16 matrix units (module docstring)"
TE_NORM = BenchCase(
    op="te-norm",
    shapes={
        k: {"seq": s, "batch": 1, "hidden": 4096 if k == "full" else 256} for k, s in _SEQ.items()
    },
    build=_te_norm,
    note="megatron: Megatron's own WrappedTorchNorm (RMSNorm), the local spec's norm",
)
TE_LAYERNORM_LINEAR = BenchCase(
    op="te-layernorm-linear",
    shapes=_gemm_shapes(lambda h: h, lambda h: 3 * h),  # the QKV projection
    build=_te_linear("layernorm-column"),
    dtypes=("float32",),
    note=f"megatron: WrappedTorchNorm then ColumnParallelLinear (the local spec); {_GEMM_NOTE}",
)
TE_COLUMN_LINEAR = BenchCase(
    op="te-column-linear",
    shapes=_gemm_shapes(lambda h: h, lambda h: 4 * h),  # FC1
    build=_te_linear("column"),
    paths=("megatron", "native"),
    dtypes=("float32",),
    note=f"megatron: ColumnParallelLinear; no NPU kernel, so no npu-binding path; {_GEMM_NOTE}",
)
TE_ROW_LINEAR = BenchCase(
    op="te-row-linear",
    shapes=_gemm_shapes(lambda h: 4 * h, lambda h: h),  # FC2
    build=_te_linear("row"),
    paths=("megatron", "native"),
    dtypes=("float32",),
    note=f"megatron: RowParallelLinear; no NPU kernel, so no npu-binding path; {_GEMM_NOTE}",
)
TE_LINEAR = BenchCase(
    op="te-linear",
    shapes=_gemm_shapes(lambda h: h, lambda h: h // 2),  # an MLA-like down-projection
    build=_te_linear("duplicated"),
    paths=("megatron", "native"),
    dtypes=("float32",),
    note="TELinear(parallel_mode='duplicated'); megatron: ColumnParallelLinear, the local MLA "
    f"spec's down-projection; no NPU kernel, so no npu-binding path; {_GEMM_NOTE}",
)
