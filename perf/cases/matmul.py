"""The torch products the ``matmul.*`` patches wrap, at a GPT layer's sizes: 2048 tokens through
a 1024 -> 1024 projection (``matmul``, ``Tensor.matmul``, ``@``, ``mm``, ``F.linear`` with bias),
and 8 heads of 2048 x 2048 attention scores over head size 128 (``bmm``, ``baddbmm`` at beta 0,
Megatron's form). fp32, bf16 and fp16: ``megatron`` times torch's own kernel (PyTorch's scalar
16-bit fallback on a CPU without 16-bit matrix instructions), ``native`` the fp32-accumulated
product the adaptor installs; on fp32 the two are the same kernel and the ratio shows the
wrapper's cost. The products call no NPU kernel (a real NPU multiplies natively), so there is no
``npu-binding`` path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from perf.case import BenchCase, Built, Cell, implementation

_DTYPES = ("float32", "bfloat16", "float16")
_PATHS = ("megatron", "native")


def _randn(cell: Cell, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=gen).to(cell.torch_dtype).requires_grad_(True)


def _projection(cell: Cell) -> Built:
    """``fn(x, w)``: tokens through a projection, as ``matmul``, ``Tensor.matmul``, ``@`` and
    ``mm`` take it."""
    n, k, m = (cell.shape[key] for key in ("tokens", "hidden", "out"))
    x, w = _randn(cell, n, k), _randn(cell, k, m)
    fn = implementation(cell)
    return Built(lambda: fn(x, w), (x, w), forward_flops=2.0 * n * k * m)


def _linear(cell: Cell) -> Built:
    n, k, m = (cell.shape[key] for key in ("tokens", "hidden", "out"))
    x, w, b = _randn(cell, n, k), _randn(cell, m, k), _randn(cell, m)
    fn = implementation(cell)
    return Built(lambda: fn(x, w, b), (x, w, b), forward_flops=2.0 * n * k * m)


def _scores(with_input: bool):
    def build(cell: Cell) -> Built:
        h, s, d = (cell.shape[key] for key in ("heads", "seq", "head_dim"))
        q, k = _randn(cell, h, s, d), _randn(cell, h, d, s)
        fn = implementation(cell)
        if with_input:
            buffer = torch.empty(h, s, s, dtype=cell.torch_dtype)

            def run():
                return fn(buffer, q, k, beta=0.0, alpha=d**-0.5)

        else:

            def run():
                return fn(q, k)

        return Built(run, (q, k), forward_flops=2.0 * h * s * s * d)

    return build


_PROJECTION = {
    "full": {"tokens": 2048, "hidden": 1024, "out": 1024},
    "quick": {"tokens": 128, "hidden": 64, "out": 64},
}
_SCORES = {
    "full": {"heads": 8, "seq": 2048, "head_dim": 128},
    "quick": {"heads": 2, "seq": 128, "head_dim": 32},
}


def _case(op: str, shapes: dict, build: Callable[[Cell], Built]) -> BenchCase:
    return BenchCase(op=op, shapes=shapes, build=build, paths=_PATHS, dtypes=_DTYPES)


TORCH_MATMUL = _case("torch-matmul", _PROJECTION, _projection)
TENSOR_MATMUL = _case("tensor-matmul", _PROJECTION, _projection)
TENSOR_MATMUL_OPERATOR = _case("tensor-matmul-operator", _PROJECTION, _projection)
TORCH_MM = _case("torch-mm", _PROJECTION, _projection)
TORCH_BMM = _case("torch-bmm", _SCORES, _scores(with_input=False))
TORCH_BADDBMM = _case("torch-baddbmm", _SCORES, _scores(with_input=True))
FUNCTIONAL_LINEAR = _case("functional-linear", _PROJECTION, _linear)
