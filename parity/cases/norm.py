"""Parity of the local-spec norm (LayerNorm / RMSNorm) against Megatron's own torch norm.

Every config option the replacement reads is drawn: ``normalization``, ``layernorm_epsilon``
(also on small-variance inputs, where eps dominates the statistics, and on inputs with a large
mean and a small spread), ``layernorm_zero_centered_gamma`` and ``sequence_parallel``. Megatron's
``WrappedTorchNorm`` refuses the last two, so the reference gets their documented meaning
instead: zero-centred gamma is a torch norm with weight ``1 + w`` (the gradient of ``w`` is
the same), and sequence parallelism changes no numerics but must mark every parameter
``sequence_parallel`` (so ``finalize_model_grads`` all-reduces its gradient over the TP group):
the run reports the marks, the reference expects all of them set.
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import generator, megatron_config


def _params():
    return st.fixed_dictionaries(
        {
            "normalization": st.sampled_from(["LayerNorm", "RMSNorm"]),
            "seq": st.integers(1, 16),
            "batch": st.integers(1, 3),
            # LayerNorm over fewer than 4 features normalises to +-1 exactly and its
            # gradients are pure rounding noise, which no accuracy metric can judge.
            "hidden": st.integers(4, 96),
            "scale": st.sampled_from([1.0, 30.0, 1e-3]),
            # a mean of offset * scale: large against the spread, but conditioned well enough
            # (x / spread ~ 80) that fp32's own LayerNorm stays inside the fp32 rule
            "offset": st.sampled_from([0.0, 0.0, 80.0]),
            "eps": st.sampled_from([1e-5, 1e-6, 1e-2]),
            "zero_centered": st.booleans(),
            "sp": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _inputs(p):
    g = generator(p)
    import torch

    shape = (p["seq"], p["batch"], p["hidden"])
    return {
        "x": (torch.randn(*shape, generator=g, dtype=torch.float64) + p["offset"]) * p["scale"],
        "weight": 1 + 0.1 * torch.randn(p["hidden"], generator=g, dtype=torch.float64),
        "bias": 0.1 * torch.randn(p["hidden"], generator=g, dtype=torch.float64),
        "grad_out": torch.randn(*shape, generator=g, dtype=torch.float64),
    }


def _forward_backward(module, ctx: Context, inputs, weight_shift: float = 0.0):
    """``weight_shift``: zero-centred gamma stores ``w = gamma - 1`` (rounded to the tested
    dtype); the tested module gets ``w``, the reference torch norm ``1 + w``."""
    import torch

    gamma = inputs["weight"]
    with torch.no_grad():
        if ctx.params["zero_centered"]:
            module.weight.copy_(ctx.value(gamma - 1.0) + weight_shift)
        else:
            module.weight.copy_(ctx.value(gamma))
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


def _config(p, tested: bool):
    options = {}
    if tested and p["zero_centered"]:
        options["layernorm_zero_centered_gamma"] = True
    if tested and p["sp"]:  # the config wants a TP size for SP; the norm runs on one rank
        options.update(sequence_parallel=True, tensor_model_parallel_size=2, num_attention_heads=2)
    return megatron_config(
        hidden_size=max(p["hidden"], 1),
        normalization=p["normalization"],
        layernorm_epsilon=p["eps"],
        **options,
    )


def _sp_marks(module, ctx: Context):
    import torch

    marks = [float(getattr(q, "sequence_parallel", False)) for q in module.parameters()]
    return torch.tensor(marks, dtype=ctx.dtype)


def _run(ctx: Context, inputs):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    p = ctx.params
    module = WrappedTorchNorm(_config(p, tested=True), p["hidden"], eps=p["eps"])
    result = _forward_backward(module, ctx, inputs)
    if p["sp"]:
        result["sequence_parallel_marks"] = _sp_marks(module, ctx)
    return result


def _reference(ctx: Context, inputs):
    import torch
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    p = ctx.params
    module = ctx.original(WrappedTorchNorm, _config(p, tested=False), p["hidden"], eps=p["eps"])
    # zero-centred gamma: the stored weight w means gamma = 1 + w
    result = _forward_backward(module, ctx, inputs, weight_shift=1.0 if p["zero_centered"] else 0.0)
    if p["sp"]:
        result["sequence_parallel_marks"] = torch.ones(
            len(list(module.parameters())), dtype=ctx.dtype
        )
    return result


def _edge(**kw):
    base = {
        "normalization": "RMSNorm",
        "seq": 4,
        "batch": 2,
        "hidden": 64,
        "scale": 1.0,
        "offset": 0.0,
        "eps": 1e-5,
        "zero_centered": False,
        "sp": False,
        "seed": 1,
    }
    base.update(kw)
    return base


WRAPPED_TORCH_NORM = ParityCase(
    name="norm",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="output, grad of input, grad of weight (and bias for LayerNorm); with sequence "
    "parallelism the parameters' sequence_parallel marks",
    edge_cases=(
        _edge(normalization="RMSNorm", seq=4, batch=2, hidden=64, scale=1e-3, eps=1e-6, seed=1),
        _edge(normalization="RMSNorm", seq=1, batch=1, hidden=1, seed=2),
        _edge(normalization="LayerNorm", seq=3, batch=2, hidden=33, scale=1e-3, seed=3),
        # eps dominating a small variance, and a large mean with a small spread
        _edge(normalization="LayerNorm", hidden=48, scale=1e-2, eps=1e-2, seed=4),
        _edge(normalization="LayerNorm", hidden=40, scale=0.05, offset=80.0, seed=5),
        # zero-centred gamma (both norms) and sequence parallelism
        _edge(normalization="RMSNorm", hidden=32, zero_centered=True, seed=6),
        _edge(normalization="LayerNorm", hidden=24, zero_centered=True, sp=True, seed=7),
    ),
)
