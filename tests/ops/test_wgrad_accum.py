"""Gradient-accumulation fusion without apex: the kernel's contract and the linear layer
using it."""

from __future__ import annotations

import pytest
import torch

import megatron_npu
from megatron_npu.ops import wgrad_accum


def _data(n=6, fan_in=5, fan_out=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, fan_in, generator=g, dtype=torch.float64)
    go = torch.randn(n, fan_out, generator=g, dtype=torch.float64)
    mg = torch.randn(fan_out, fan_in, generator=g, dtype=torch.float64)
    return x.to(dtype), go.to(dtype), mg


def test_fp32_kernel_accumulates_in_fp32_from_bf16_inputs():
    x, go, mg = _data(n=512, dtype=torch.bfloat16)
    main_grad = mg.to(torch.float32)
    wgrad_accum.wgrad_gemm_accum_fp32(x, go, main_grad)
    exact = mg + go.double().t() @ x.double()
    # fp32 accumulation of exactly representable bf16 products: close to fp64, far closer than
    # a bf16 GEMM (whose relative error is ~4e-3)
    assert torch.allclose(main_grad.double(), exact, rtol=0, atol=1e-4)
    bf16_gemm = mg + (go.t() @ x).double()
    assert (bf16_gemm - exact).abs().max() > 10 * (main_grad.double() - exact).abs().max()


def test_fp16_kernel_rounds_once_into_a_16_bit_main_grad():
    x, go, mg = _data(dtype=torch.bfloat16)
    main_grad = mg.to(torch.bfloat16)
    start = main_grad.clone()
    wgrad_accum.wgrad_gemm_accum_fp16(x, go, main_grad)
    want = (start.double() + go.double().t() @ x.double()).to(torch.bfloat16)
    assert torch.equal(main_grad, want)


@pytest.mark.parametrize(
    "kernel, main_dtype, message",
    [
        ("wgrad_gemm_accum_fp32", torch.bfloat16, "must be float32"),
        ("wgrad_gemm_accum_fp16", torch.float32, "must be float16 or bfloat16"),
    ],
)
def test_kernels_refuse_the_wrong_main_grad_dtype(kernel, main_dtype, message):
    x, go, mg = _data()
    with pytest.raises(TypeError, match=message):
        getattr(wgrad_accum, kernel)(x, go, mg.to(main_dtype))


def test_kernels_name_shapes_that_do_not_chain():
    x, go, mg = _data()
    with pytest.raises(ValueError, match="shapes do not chain"):
        wgrad_accum.wgrad_gemm_accum_fp32(x, go, mg.t().contiguous().float())


@pytest.mark.usefixtures("gloo_world_of_one")
def test_linear_layer_accumulates_into_main_grad():
    """Megatron's ColumnParallelLinear built with gradient_accumulation_fusion (Megatron-LM's
    default) adds the weight gradient to main_grad; without the adaptor it refuses to build
    (no apex extension)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron_npu.parity.cases._common import megatron_config

    megatron_npu.apply("cpu")
    config = megatron_config(gradient_accumulation_fusion=True)
    layer = ColumnParallelLinear(
        8, 6, config=config, init_method=torch.nn.init.normal_, bias=False, gather_output=True
    )
    layer.weight.main_grad = torch.zeros(6, 8)
    x = torch.randn(5, 2, 8, requires_grad=True)
    out, _ = layer(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want = grad_out.reshape(-1, 6).t().double() @ x.detach().reshape(-1, 8).double()
    assert torch.allclose(layer.weight.main_grad.double(), want, atol=1e-5)
    megatron_npu.restore()
    from megatron.core.tensor_parallel import layers

    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda")  # restore removed what it made
    assert layers._grad_accum_fusion_available is False
