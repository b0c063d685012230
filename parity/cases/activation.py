"""Parity of Megatron's fused bias-activations routed to the op layer (``npu_swiglu`` /
``npu_gelu`` on the NPU).

The references are Megatron's own implementations (``ctx.original``): ``bias_swiglu_impl`` with
its ``BiasSwiGLUFunction`` / ``SwiGLUFunction`` and hand-written backward, and
``GeLUFunction.apply`` with the tanh-approximation forward and backward. They are
device-neutral torch code; their ``jit_fuser`` is ``torch.compile``, which is run eagerly (same
maths, no compile time).
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import eager, generator, grads


def _params(bias_optional: bool):
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 16),
            # None: a 2-D [tokens, hidden] input (Megatron's MoE experts call it that way)
            "batch": st.sampled_from([None, 1, 2, 3]),
            "hidden": st.integers(1, 96),
            "bias": st.booleans() if bias_optional else st.just(True),
            "scale": st.sampled_from([1.0, 4.0]),
            "seed": st.integers(0, 2**16),
        }
    )


def _inputs(width):
    def make(p):
        import torch

        g = generator(p)
        lead = (p["seq"],) if p["batch"] is None else (p["seq"], p["batch"])
        n = width(p["hidden"])
        return {
            "x": torch.randn(*lead, n, generator=g, dtype=torch.float64) * p["scale"],
            "bias": 0.5 * torch.randn(n, generator=g, dtype=torch.float64),
            "grad_out": torch.randn(*lead, p["hidden"], generator=g, dtype=torch.float64),
        }

    return make


def _call(fn, ctx: Context, inputs):
    x = ctx.tensor(inputs["x"], grad=True)
    bias = ctx.tensor(inputs["bias"], grad=True) if ctx.params["bias"] else None
    out = fn(x, bias)
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, bias=bias)}


def _run_swiglu(ctx: Context, inputs):
    from megatron.core.fusions import fused_bias_swiglu

    return _call(fused_bias_swiglu.bias_swiglu_impl, ctx, inputs)


def _run_gelu(ctx: Context, inputs):
    from megatron.core.fusions import fused_bias_gelu

    return _call(fused_bias_gelu.bias_gelu_impl, ctx, inputs)


def _reference(ctx: Context, inputs):
    with eager():
        return _call(ctx.original, ctx, inputs)


def _edge(**kw):
    base = {"seq": 4, "batch": 2, "hidden": 64, "bias": True, "scale": 1.0, "seed": 1}
    base.update(kw)
    return base


BIAS_SWIGLU = ParityCase(
    name="bias-swiglu",
    params=_params(bias_optional=True),
    make_inputs=_inputs(lambda h: 2 * h),
    run=_run_swiglu,
    reference=_reference,
    compares="output silu(a) * b of the two halves of x + bias; grads of x and bias",
    reference_kind="Megatron's bias_swiglu_impl (BiasSwiGLUFunction) on CPU, eager, inputs upcast",
    edge_cases=(
        _edge(),
        _edge(bias=False, seed=2),  # SwiGLUFunction, no bias
        _edge(batch=None, seq=16, hidden=48, seed=3),  # 2-D input
        _edge(seq=1, batch=1, hidden=1, seed=4),  # one pair of features
    ),
)

BIAS_GELU = ParityCase(
    name="bias-gelu",
    params=_params(bias_optional=False),
    make_inputs=_inputs(lambda h: h),
    run=_run_gelu,
    reference=_reference,
    compares="output gelu_tanh(x + bias); grads of x and bias",
    reference_kind="Megatron's GeLUFunction (tanh bias_gelu / bias_gelu_back) on CPU, eager, "
    "inputs upcast",
    edge_cases=(
        _edge(),
        _edge(batch=None, seq=16, hidden=48, seed=3),
        # one element (of moderate size: for x + bias below about -9 the tanh saturates and
        # the fp32 GELU is exactly 0, which the cosine rule cannot judge on one element)
        _edge(seq=1, batch=1, hidden=1, seed=4),
        _edge(seq=16, batch=3, hidden=96, scale=4.0, seed=5),  # long bias-gradient sums
    ),
)
