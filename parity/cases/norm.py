"""Parity of the local-spec norm (LayerNorm / RMSNorm) against Megatron's own torch norm."""

from __future__ import annotations

from hypothesis import strategies as st

from parity.case import Context, ParityCase
from parity.cases._common import generator, megatron_config


def _params():
    return st.fixed_dictionaries(
        {
            "normalization": st.sampled_from(["LayerNorm", "RMSNorm"]),
            "seq": st.integers(1, 16),
            "batch": st.integers(1, 3),
            # LayerNorm over fewer than 4 features normalises to +-1 exactly and its
            # gradients are pure rounding noise, which no accuracy metric can judge.
            "hidden": st.integers(4, 96),
            "scale": st.sampled_from([1.0, 30.0]),
            "eps": st.sampled_from([1e-5, 1e-6]),
            "seed": st.integers(0, 2**16),
        }
    )


def _inputs(p):
    g = generator(p)
    import torch

    shape = (p["seq"], p["batch"], p["hidden"])
    return {
        "x": torch.randn(*shape, generator=g, dtype=torch.float64) * p["scale"],
        "weight": 1 + 0.1 * torch.randn(p["hidden"], generator=g, dtype=torch.float64),
        "bias": 0.1 * torch.randn(p["hidden"], generator=g, dtype=torch.float64),
        "grad_out": torch.randn(*shape, generator=g, dtype=torch.float64),
    }


def _forward_backward(module, ctx: Context, inputs):
    import torch

    with torch.no_grad():
        module.weight.copy_(ctx.value(inputs["weight"]))
        if getattr(module, "bias", None) is not None:
            module.bias.copy_(ctx.value(inputs["bias"]))
    module.to(device=ctx.device, dtype=ctx.dtype)
    x = ctx.tensor(inputs["x"], grad=True)
    out = module(x)
    out.backward(ctx.tensor(inputs["grad_out"]))
    result = {"out": out, "grad_x": x.grad, "grad_weight": module.weight.grad}
    if getattr(module, "bias", None) is not None:
        result["grad_bias"] = module.bias.grad
    return result


def _config(p):
    return megatron_config(
        hidden_size=max(p["hidden"], 1), normalization=p["normalization"],
        layernorm_epsilon=p["eps"],
    )  # fmt: skip


def _run(ctx: Context, inputs):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    p = ctx.params
    module = WrappedTorchNorm(_config(p), p["hidden"], eps=p["eps"])
    return _forward_backward(module, ctx, inputs)


def _reference(ctx: Context, inputs):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    p = ctx.params
    module = ctx.original(WrappedTorchNorm, _config(p), p["hidden"], eps=p["eps"])
    return _forward_backward(module, ctx, inputs)


WRAPPED_TORCH_NORM = ParityCase(
    name="norm",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="output, grad of input, grad of weight (and bias for LayerNorm)",
    edge_cases=(
        {
            "normalization": "RMSNorm",
            "seq": 4,
            "batch": 2,
            "hidden": 64,
            "scale": 1e-3,
            "eps": 1e-6,
            "seed": 1,
        },
        {
            "normalization": "RMSNorm",
            "seq": 1,
            "batch": 1,
            "hidden": 1,
            "scale": 1.0,
            "eps": 1e-5,
            "seed": 2,
        },
        {
            "normalization": "LayerNorm",
            "seq": 3,
            "batch": 2,
            "hidden": 33,
            "scale": 1e-3,
            "eps": 1e-5,
            "seed": 3,
        },
    ),  # fmt: skip
)
