"""Parity of Megatron's ``vocab_parallel_cross_entropy`` routed to the op layer's fp32 op.

Every tensor-parallel rank takes its vocab shard of the full logits, calls
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (the name Megatron's GPT model
calls; the patched function, with the TP all-reduces), back-propagates the upstream loss
gradient, and the logits gradient is all-gathered over the TP group so rank 0 returns the full,
un-sharded tensor. TP1/2/4 run on real gloo groups. The logits are an activation (``leaf * 1``,
as the output layer hands them over: fp32 ones are worked on in place) or, with
``activation=False``, a leaf (read in row chunks, left unchanged).

The reference is independent plain torch on the full logits in the upcast dtype: per-token
``-log_softmax(logits)[target]`` and, with label smoothing ``a`` over the *global* vocab ``K``,
the op's documented formula ``(1 - s) * nll - s * mean(log_probs)``, ``s = a * K / (K - 1)``
(target weight ``1 - a``, every other token ``a / (K - 1)``); the gradient by autograd.
Megatron's original is not the reference: with TP > 1 it smooths over the local shard size.
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, Parallel, ParityCase
from megatron_npu.parity.cases._common import gather, generator, megatron_parallel

_MAX_TP = 4  # the vocab is a multiple of this, so every parallel size divides it


def _params():
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 8),
            "batch": st.integers(1, 2),
            "vocab": st.integers(16, 160).map(lambda v: v * _MAX_TP),
            "label_smoothing": st.sampled_from([0.0, 0.1]),
            "logit_scale": st.sampled_from([1.0, 10.0]),
            "activation": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _inputs(p):
    import torch

    g = generator(p)
    s, b, v = p["seq"], p["batch"], p["vocab"]
    target = torch.randint(0, v, (s, b), generator=g)
    # targets on the shard boundaries of every parallel size, and the first / last id
    edges = torch.tensor([0, v - 1] + [k * v // t for t in (2, 4) for k in range(1, t)])
    flat = target.view(-1)
    flat[: min(flat.numel(), edges.numel())] = edges[: flat.numel()]
    return {
        "logits": torch.randn(s, b, v, generator=g, dtype=torch.float64) * p["logit_scale"],
        "target": target,
        "grad_loss": torch.rand(s, b, generator=g, dtype=torch.float64) + 0.5,
    }


def _run(ctx: Context, inputs):
    from megatron.core import parallel_state, tensor_parallel

    with megatron_parallel():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        logits = ctx.tensor(inputs["logits"])
        local = logits.chunk(tp, dim=-1)[rank].detach().clone().requires_grad_(True)
        handed = local * 1.0 if ctx.params["activation"] else local
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            handed, ctx.tensor(inputs["target"]), label_smoothing=ctx.params["label_smoothing"]
        )
        loss.backward(ctx.tensor(inputs["grad_loss"]).to(loss.dtype))
        group = parallel_state.get_tensor_model_parallel_group()
        return {"loss": loss, "grad_logits": gather(local.grad, group, dim=-1)}


def _reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    logits = ctx.tensor(inputs["logits"], grad=True)
    target = inputs["target"]
    log_probs = torch.log_softmax(logits, dim=-1)
    loss = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if p["label_smoothing"] > 0:
        k = logits.shape[-1]
        s = p["label_smoothing"] * k / (k - 1)
        loss = (1 - s) * loss - s * log_probs.mean(dim=-1)
    loss.backward(ctx.tensor(inputs["grad_loss"]))
    return {"loss": loss, "grad_logits": logits.grad}


def _edge(**kw):
    base = {
        "seq": 4,
        "batch": 2,
        "vocab": 256,
        "label_smoothing": 0.0,
        "logit_scale": 1.0,
        "activation": True,
    }
    base.update(kw)
    return base


VOCAB_PARALLEL_CROSS_ENTROPY = ParityCase(
    name="cross-entropy",
    params=_params(),
    make_inputs=_inputs,
    run=_run,
    reference=_reference,
    compares="per-token loss [s, b] (fp32) and the full logits gradient [s, b, V] "
    "(all-gathered over TP)",
    reference_kind="plain torch log-softmax NLL (+ label smoothing over the global vocab) on the "
    "full logits, CPU, inputs upcast",
    parallel=(Parallel(), Parallel(tp=2), Parallel(tp=4)),
    edge_cases=(
        _edge(seed=1),
        _edge(label_smoothing=0.1, seed=2),
        # peaked logits: log-sum-exp far from the max logit only if computed stably
        _edge(seq=8, vocab=512, logit_scale=10.0, label_smoothing=0.1, seed=3),
        _edge(seq=1, batch=1, vocab=64, seed=4),  # one token, 16 ids per rank at TP4
        _edge(label_smoothing=0.1, activation=False, seed=5),  # a leaf: the chunked path
    ),
)
