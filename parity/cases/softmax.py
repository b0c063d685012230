"""Parity of ``FusedScaleMaskSoftmax.forward_fused_softmax`` routed to the scaled-masked-softmax
op (``npu_scaled_masked_softmax`` on the NPU).

``forward_fused_softmax`` is called directly, also for fp32 (Megatron only reaches it for
fp16/bf16, but the op takes fp32 and calling it directly checks its maths there too); shapes stay
inside the kernel's documented limits (sq, sk in 32..4096 and multiples of 32; causal needs
sq == sk). The reference is Megatron's own ``forward_torch_softmax`` path (scale, causal mask or
the given padding mask filled with -10000, torch softmax) in the upcast dtype: the original
``forward_fused_softmax`` calls CUDA extensions and cannot run here.
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import generator, grads


@st.composite
def _params(draw):
    mask = draw(st.sampled_from(["causal", "padding", "padding_rows"]))
    sq = 32 * draw(st.integers(1, 4))
    sk = sq if mask == "causal" else 32 * draw(st.integers(1, 4))
    return {
        "mask": mask,
        "batch": draw(st.integers(1, 2)),
        "heads": draw(st.integers(1, 3)),
        "sq": sq,
        "sk": sk,
        "scale": draw(st.sampled_from([None, 1.0, 0.125, 3.0])),
        "x_scale": draw(st.sampled_from([1.0, 8.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(p):
    import torch

    g = generator(p)
    b, n, sq, sk = p["batch"], p["heads"], p["sq"], p["sk"]
    x = torch.randn(b, n, sq, sk, generator=g, dtype=torch.float64) * p["x_scale"]
    if p["mask"] == "padding_rows":
        # an arbitrary [b, 1, sq, sk] mask with some rows masked out entirely (padded queries):
        # both the op and Megatron fill with -10000, so such a row comes out uniform
        mask = torch.rand(b, 1, sq, sk, generator=g) < 0.3
        mask[:, :, -3:, :] = True
    else:  # key padding: batch row i keeps its first lengths[i] keys
        lengths = torch.randint(1, sk + 1, (b,), generator=g)
        mask = (torch.arange(sk).view(1, 1, 1, sk) >= lengths.view(b, 1, 1, 1)).expand(b, 1, sq, sk)
    return {
        "x": x,
        "mask": mask.contiguous(),
        "grad_out": torch.randn(b, n, sq, sk, generator=g, dtype=torch.float64),
    }


def _module(p, dtype):
    import torch
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(
        input_in_fp16=dtype == torch.float16,
        input_in_bf16=dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal if p["mask"] == "causal" else AttnMaskType.padding,
        scaled_masked_softmax_fusion=True,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=p["scale"],
    )


def _mask(ctx: Context, inputs):
    return None if ctx.params["mask"] == "causal" else ctx.tensor(inputs["mask"])


def _run(ctx: Context, inputs):
    module = _module(ctx.params, ctx.dtype)
    x = ctx.tensor(inputs["x"], grad=True)
    out = module.forward_fused_softmax(x.clone(), _mask(ctx, inputs))
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x)}


def _reference(ctx: Context, inputs):
    # input_in_fp16/bf16 False: Megatron's torch path computes in the (upcast) input dtype
    module = _module(ctx.params, ctx.dtype)
    x = ctx.tensor(inputs["x"], grad=True)
    # a non-leaf, as Megatron's scores are: its mask_func fills them in place
    out = module.forward_torch_softmax(x.clone(), _mask(ctx, inputs))
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x)}


def _edge(**kw):
    base = {"batch": 1, "heads": 1, "scale": None, "x_scale": 1.0}
    base.update(kw)
    return base


FUSED_SOFTMAX = ParityCase(
    name="softmax",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="softmax probabilities [b, np, sq, sk] and grad of the scores",
    reference_kind="Megatron's FusedScaleMaskSoftmax.forward_torch_softmax on CPU, inputs upcast",
    edge_cases=(
        _edge(mask="causal", batch=2, heads=2, sq=64, sk=64, scale=3.0, seed=1),
        _edge(mask="padding", batch=2, sq=32, sk=96, x_scale=8.0, seed=2),
        _edge(mask="padding_rows", heads=2, sq=64, sk=32, scale=0.125, seed=3),
        # the kernel's limits: the smallest and the largest key length
        _edge(mask="causal", sq=32, sk=32, seed=4),
        _edge(mask="padding", sq=32, sk=4096, scale=1.0, x_scale=8.0, seed=5),
    ),
)
