"""Parity of the torch products the ``matmul.*`` patches wrap (fp16/bf16 as one fp32 product
rounded once on the CPU stand-in devices).

Each case calls the product the way Megatron does (looked up on ``torch`` / the tensor at call
time, so the installed wrapper runs) and compares it with torch's original product on the
upcast inputs. The drawn examples reach every side of the wrapper: fp16/bf16 cells take the
fp32 product, fp32 cells and calls with an ``out=`` buffer of the operands' dtype reach the
original unchanged, and an fp32 buffer for 16-bit operands (Megatron-FSDP's weight gradient)
takes the fp32 product unrounded. Shapes cover what
Megatron multiplies: plain and batched matrices, a 2-D weight broadcast over leading dimensions,
vectors, ``baddbmm``'s ``beta`` 0 (Megatron's attention scores) and 1, a linear with and without
bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import generator


def _dims() -> dict[str, Any]:
    return {
        "n": st.integers(1, 24),
        "k": st.integers(1, 48),
        "m": st.integers(1, 24),
        "seed": st.integers(0, 2**16),
    }


def _randn(p: dict[str, Any], *shapes: tuple[int, ...]) -> list:
    import torch

    g = generator(p)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _matmul_shapes(p: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Operand shapes for ``matmul``'s forms: 2-D, batched, a 2-D right operand broadcast over
    the batch (a linear layer's weight), a vector on either side."""
    n, k, m, form = p["n"], p["k"], p["m"], p["form"]
    return {
        "2d": ((n, k), (k, m)),
        "batched": ((2, n, k), (2, k, m)),
        "broadcast": ((3, 2, n, k), (k, m)),
        "vector-left": ((k,), (2, k, m)),
        "vector-right": ((2, n, k), (k,)),
    }[form]


def _product_case(
    name: str,
    call: Callable[[Callable, list, dict], Any],
    shapes: Callable[[dict[str, Any]], tuple[tuple[int, ...], ...]],
    extra: dict[str, Any],
    takes_out: bool,
    compares: str,
    edge_cases: tuple[dict[str, Any], ...],
) -> ParityCase:
    """A case for one wrapped product: ``call(fn, operands, params)`` multiplies with ``fn``
    (the installed product, or the original for the reference)."""
    params = {**_dims(), **extra}
    if takes_out:
        params["out"] = st.booleans()
        params["out_fp32"] = st.booleans()  # with out: an fp32 buffer, whatever the operands

    def make_inputs(p: dict[str, Any]) -> dict:
        operands = _randn(p, *shapes(p))
        return {f"x{i}": t for i, t in enumerate(operands)}

    def evaluate(fn: Callable, ctx: Context, inputs: dict) -> dict:
        import torch

        use_out = bool(ctx.params.get("out"))
        operands = [ctx.tensor(inputs[f"x{i}"], grad=not use_out) for i in range(len(inputs))]
        if use_out:  # an output buffer: no autograd, the product written in the buffer's dtype
            probe = call(fn, operands, ctx.params)
            wide = ctx.params.get("out_fp32") and fn is None  # the reference's stays its own
            buffer = torch.empty_like(probe, dtype=torch.float32 if wide else probe.dtype)
            result = call(fn, operands, {**ctx.params, "out_buffer": buffer})
            assert result.data_ptr() == buffer.data_ptr()
            return {"out": result}
        out = call(fn, operands, ctx.params)
        g = generator({"seed": ctx.params["seed"] + 1})
        grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
        out.backward(ctx.tensor(grad_out).to(out.dtype))
        return {"out": out, **{f"grad_x{i}": t.grad for i, t in enumerate(operands)}}

    def run(ctx: Context, inputs: dict) -> dict:
        return evaluate(None, ctx, inputs)

    def reference(ctx: Context, inputs: dict) -> dict:
        return evaluate(ctx.original, ctx, inputs)

    return ParityCase(
        name=name,
        params=st.fixed_dictionaries(params),
        make_inputs=make_inputs,
        run=run,
        reference=reference,
        compares=compares,
        reference_kind="torch's own product on CPU, inputs upcast",
        edge_cases=edge_cases,
    )


def _out(params: dict[str, Any]) -> dict[str, Any]:
    buffer = params.get("out_buffer")
    return {} if buffer is None else {"out": buffer}


def _torch(name: str) -> Callable:
    """``torch.<name>`` as installed at call time, unless the reference's original is given."""

    def call(fn, operands, params):
        import torch

        return (fn or getattr(torch, name))(*operands, **_out(params))

    return call


def _tensor_method(fn, operands, params):
    import torch

    return (fn or torch.Tensor.matmul)(*operands)


def _operator(fn, operands, params):
    a, b = operands
    return a @ b if fn is None else fn(a, b)


def _baddbmm(fn, operands, params):
    import torch

    scale = {"beta": params["beta"], "alpha": params["alpha"]}
    return (fn or torch.baddbmm)(*operands, **scale, **_out(params))


def _linear(fn, operands, params):
    import torch

    return (fn or torch.nn.functional.linear)(*operands)


_FORMS = {"form": st.sampled_from(["2d", "batched", "broadcast", "vector-left", "vector-right"])}


def _edge(**kw: Any) -> dict[str, Any]:
    return {"n": 8, "k": 32, "m": 8, "seed": 1, **kw}


_MATMUL_EDGES = (
    _edge(form="broadcast", out=False),
    _edge(form="vector-left", out=False, seed=2),
    _edge(form="2d", n=1, k=1, m=1, out=False, seed=3),
    _edge(form="batched", out=True, seed=4),
    _edge(form="2d", out=True, out_fp32=True, seed=5),  # Megatron-FSDP's weight gradient
)


def _no_out(edges: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    return tuple({k: v for k, v in e.items() if k not in ("out", "out_fp32")} for e in edges)


TORCH_MATMUL = _product_case(
    "torch-matmul",
    _torch("matmul"),
    _matmul_shapes,
    _FORMS,
    True,
    "torch.matmul's product and the grads of both operands",
    _MATMUL_EDGES,
)
TENSOR_MATMUL = _product_case(
    "tensor-matmul",
    _tensor_method,
    _matmul_shapes,
    _FORMS,
    False,
    "Tensor.matmul's product (Megatron's linear backward) and the grads of both operands",
    _no_out(_MATMUL_EDGES),
)
TENSOR_MATMUL_OPERATOR = _product_case(
    "tensor-matmul-operator",
    _operator,
    _matmul_shapes,
    _FORMS,
    False,
    "a @ b and the grads of both operands",
    _no_out(_MATMUL_EDGES),
)
TORCH_MM = _product_case(
    "torch-mm",
    _torch("mm"),
    lambda p: ((p["n"], p["k"]), (p["k"], p["m"])),
    {},
    True,
    "torch.mm's product and the grads of both operands",
    (
        _edge(out=False),
        _edge(n=1, k=1, m=1, out=False, seed=3),
        _edge(out=True, seed=4),
        _edge(out=True, out_fp32=True, seed=5),
    ),
)
TORCH_BMM = _product_case(
    "torch-bmm",
    _torch("bmm"),
    lambda p: ((3, p["n"], p["k"]), (3, p["k"], p["m"])),
    {},
    True,
    "torch.bmm's product (attention's probs @ values) and the grads of both operands",
    (_edge(out=False), _edge(n=1, k=1, m=1, out=False, seed=3), _edge(out=True, seed=4)),
)
TORCH_BADDBMM = _product_case(
    "torch-baddbmm",
    _baddbmm,
    lambda p: ((3, p["n"], p["m"]), (3, p["n"], p["k"]), (3, p["k"], p["m"])),
    {"beta": st.sampled_from([0.0, 1.0]), "alpha": st.sampled_from([1.0, 0.125])},
    True,
    "beta * input + alpha * (batch1 @ batch2) (attention's scores at beta 0) and the grads of "
    "all three operands",
    (
        _edge(beta=0.0, alpha=0.125, out=False),
        _edge(beta=1.0, alpha=1.0, out=False, seed=2),
        _edge(beta=0.0, alpha=1.0, out=True, seed=4),
    ),
)
FUNCTIONAL_LINEAR = _product_case(
    "functional-linear",
    _linear,
    lambda p: ((2, p["n"], p["k"]), (p["m"], p["k"])) + (((p["m"],),) if p["bias"] else ()),
    {"bias": st.booleans()},
    False,
    "F.linear's output (x @ weight.T + bias) and the grads of input, weight and bias",
    (_edge(bias=True), _edge(bias=False, seed=2), _edge(bias=True, n=1, k=1, m=1, seed=3)),
)
