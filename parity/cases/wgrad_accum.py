"""Parity of gradient-accumulation fusion: Megatron's tensor-parallel linear function with
``gradient_accumulation_fusion=True`` accumulating the weight gradient into ``weight.main_grad``
through the adaptor's ``fused_weight_gradient_mlp_cuda`` stand-in.

The patched path is the whole ``linear_with_grad_accumulation_and_async_allreduce`` (forward,
input gradient, and the fused accumulate in its backward). ``main_grad`` is fp32 (Megatron's
default for fp32 params and with ``--accumulate-allreduce-grads-in-fp32``: the ``_fp32`` kernel) or
in the tested dtype (bf16/fp16 params without it: the ``_fp16`` kernel); both are drawn. The
reference is the algebra in the upcast dtype: ``out = x W^T``, ``grad_x = g W``, ``main_grad +=
g^T x`` over all tokens (the original target does not exist without apex, so it cannot be
called).

Under Megatron-FSDP (a weight marked ``__fsdp_param__``, megatron-core 0.14+) the same backward
*writes* the weight gradient into the buffer ``weight.get_main_grad()`` hands out: through
``torch.matmul(..., out=)`` up to megatron-core 0.17, through ``te_general_gemm`` from 0.18. An
fp32 buffer takes the 16-bit product unrounded, as TE's GEMM gives it on a GPU.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import generator, megatron_parallel


def _params():
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 12),
            "batch": st.integers(1, 3),
            "fan_in": st.integers(1, 48),
            "fan_out": st.integers(1, 48),
            "main_grad_fp32": st.booleans(),
            "bias": st.booleans(),
            "fsdp": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


@functools.cache
def _backward_serves_fsdp() -> bool:
    """Whether the installed megatron-core's linear backward has the Megatron-FSDP branch
    (0.14+); read once, the source does not change while the process runs."""
    import inspect

    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication as Linear,
    )

    return "__fsdp_param__" in inspect.getsource(Linear.backward)


def _fsdp(ctx: Context) -> bool:
    """Whether the example's weight is a Megatron-FSDP parameter: drawn so, and served."""
    return bool(ctx.params.get("fsdp")) and _backward_serves_fsdp()


def _inputs(p):
    import torch

    g = generator(p)
    s, b, i, o = p["seq"], p["batch"], p["fan_in"], p["fan_out"]
    return {
        "x": torch.randn(s, b, i, generator=g, dtype=torch.float64),
        "weight": torch.randn(o, i, generator=g, dtype=torch.float64) / max(i, 1) ** 0.5,
        "bias": torch.randn(o, generator=g, dtype=torch.float64),
        "grad_out": torch.randn(s, b, o, generator=g, dtype=torch.float64),
        "main_grad": torch.randn(o, i, generator=g, dtype=torch.float64),
    }


def _main_grad_dtype(ctx: Context):
    import torch

    return torch.float32 if ctx.params["main_grad_fp32"] else ctx.tested_dtype


def _run(ctx: Context, inputs):
    import torch
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    with megatron_parallel():
        x = ctx.tensor(inputs["x"], grad=True)
        weight = torch.nn.Parameter(ctx.tensor(inputs["weight"]))
        weight.main_grad = inputs["main_grad"].to(_main_grad_dtype(ctx)).to(ctx.device)
        if _fsdp(ctx):  # Megatron-FSDP hands out its gradient buffer, which the GEMM overwrites
            buffer = weight.main_grad
            weight.__fsdp_param__ = True
            weight.get_main_grad = lambda: buffer
        bias = ctx.tensor(inputs["bias"]) if ctx.params["bias"] else None
        out = linear_with_grad_accumulation_and_async_allreduce(
            x,
            weight,
            bias,
            gradient_accumulation_fusion=True,
            allreduce_dgrad=False,
            sequence_parallel=False,
        )
        out.backward(ctx.tensor(inputs["grad_out"]))
    return {"out": out, "grad_x": x.grad, "main_grad": weight.main_grad}


def _reference(ctx: Context, inputs):
    import torch

    x, w = ctx.tensor(inputs["x"]), ctx.tensor(inputs["weight"])
    g = ctx.tensor(inputs["grad_out"])
    out = x @ w.t()
    if ctx.params["bias"]:
        out = out + ctx.tensor(inputs["bias"])
    # the weight gradient accumulates in main_grad's precision when that is wider (the kernel's
    # contract): so the 16-bit benchmark run keeps an fp32 main_grad's sum in fp32
    acc = torch.promote_types(ctx.dtype, _main_grad_dtype(ctx))
    start = inputs["main_grad"].to(_main_grad_dtype(ctx)).to(acc)
    flat_g, flat_x = g.reshape(-1, g.shape[-1]).to(acc), x.reshape(-1, x.shape[-1]).to(acc)
    wgrad = flat_g.t() @ flat_x
    return {"out": out, "grad_x": g @ w, "main_grad": wgrad if _fsdp(ctx) else start + wgrad}


def _edge(**kw):
    base = {
        "seq": 8,
        "batch": 2,
        "fan_in": 32,
        "fan_out": 24,
        "main_grad_fp32": True,
        "bias": True,
        "fsdp": False,
        "seed": 1,
    }
    base.update(kw)
    return base


GRADIENT_ACCUMULATION_FUSION = ParityCase(
    name="gradient-accumulation-fusion",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="linear output, input gradient, and main_grad after the fused weight-gradient "
    "accumulate (fp32 or 16-bit main_grad), or under Megatron-FSDP the weight gradient written "
    "into its buffer",
    reference_kind="x W^T, g W and main_grad + g^T x in the upcast dtype (no stock CUDA kernel "
    "exists to call)",
    edge_cases=(
        _edge(),
        _edge(main_grad_fp32=False, seed=2),  # the _fp16 kernel (16-bit main_grad)
        _edge(seq=1, batch=1, fan_in=1, fan_out=1, seed=3),
        _edge(seq=12, batch=3, fan_in=48, fan_out=48, bias=False, seed=4),  # long token sums
        _edge(fsdp=True, seed=5),  # Megatron-FSDP: the fp32 buffer takes the product
        _edge(fsdp=True, main_grad_fp32=False, seed=6),  # and a 16-bit buffer
    ),
)
