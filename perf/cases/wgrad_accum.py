"""Weight-gradient accumulation into ``main_grad`` at a GPT FFN size (tokens 2048, 4096 -> 8192).

``megatron`` is what Megatron runs without the fused extension (``--no-gradient-accumulation-
fusion``): the weight gradient as its own GEMM in the activations' dtype, then the DDP hook's
``main_grad.add_``. The other path is the adaptor's kernel (``wgrad_gemm_accum_fp32``), fp32
accumulation straight into ``main_grad``.
"""

from __future__ import annotations

import torch

from perf.case import BenchCase, Built, Cell, installed_of


def _build(cell: Cell) -> Built:
    n, fan_in, fan_out = (cell.shape[k] for k in ("tokens", "in", "out"))
    gen = torch.Generator().manual_seed(0)
    total_input = torch.randn(n, fan_in, generator=gen).to(cell.torch_dtype)
    grad_output = torch.randn(n, fan_out, generator=gen).to(cell.torch_dtype)
    main_grad = torch.zeros(fan_out, fan_in, dtype=torch.float32)
    if cell.path == "megatron":

        def run() -> None:
            main_grad.add_(torch.matmul(grad_output.t(), total_input))

    else:
        kernel = installed_of(cell).wgrad_gemm_accum_fp32

        def run() -> None:
            kernel(total_input, grad_output, main_grad)

    return Built(run)


GRADIENT_ACCUMULATION_FUSION = BenchCase(
    op="wgrad-gemm-accum",
    shapes={
        "full": {"tokens": 2048, "in": 4096, "out": 8192},
        "quick": {"tokens": 256, "in": 256, "out": 512},
    },
    build=_build,
    paths=("megatron", "native"),
    directions=("fwd",),
    note="the kernel is one GEMM + accumulate: no backward of its own",
)
