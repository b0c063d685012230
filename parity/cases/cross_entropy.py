"""Parity of Megatron's ``vocab_parallel_cross_entropy`` routed to the op layer's fp32 op, and of
Transformer Engine's ``te_parallel_cross_entropy`` (``--cross-entropy-fusion-impl te``) served by
it (``TE_PARALLEL_CROSS_ENTROPY``: labels of -100 lose nothing; the reference is torch's
``cross_entropy`` with that ``ignore_index``).

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


def _te_params():
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 8),
            "batch": st.integers(1, 2),
            "vocab": st.integers(16, 160).map(lambda v: v * _MAX_TP),
            "ignored": st.sampled_from([0.0, 0.3]),
            "logit_scale": st.sampled_from([1.0, 10.0]),
            "seed": st.integers(0, 2**16),
        }
    )


def _te_inputs(p):
    import torch

    inputs = _inputs({**p, "label_smoothing": 0.0, "activation": True})
    g = generator({**p, "seed": p["seed"] + 1})
    target = inputs["target"]
    ignored = torch.rand(target.shape, generator=g) < p["ignored"]
    if p["ignored"] and target.numel() > 1:
        ignored.view(-1)[-1] = True  # at least one ignored token where the draw asks for some
    inputs["target"] = target.masked_fill(ignored, -100)
    return inputs


def _te_run(ctx: Context, inputs):
    from megatron.core import parallel_state
    from megatron.core.models.common.language_module import language_module

    with megatron_parallel():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        logits = ctx.tensor(inputs["logits"])
        local = logits.chunk(tp, dim=-1)[rank].detach().clone().requires_grad_(True)
        loss = language_module.te_parallel_cross_entropy(
            local * 1.0, ctx.tensor(inputs["target"]), group
        )
        loss.backward(ctx.tensor(inputs["grad_loss"]).to(loss.dtype))
        return {"loss": loss, "grad_logits": gather(local.grad, group, dim=-1)}


def _te_reference(ctx: Context, inputs):
    import torch

    logits = ctx.tensor(inputs["logits"], grad=True)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), inputs["target"].flatten(), ignore_index=-100, reduction="none"
    ).view(inputs["target"].shape)
    loss.backward(ctx.tensor(inputs["grad_loss"]))
    return {"loss": loss, "grad_logits": logits.grad}


def _te_edge(**kw):
    base = {"seq": 4, "batch": 2, "vocab": 256, "ignored": 0.3, "logit_scale": 1.0}
    base.update(kw)
    return base


TE_PARALLEL_CROSS_ENTROPY = ParityCase(
    name="te-cross-entropy",
    params=_te_params(),
    make_inputs=_te_inputs,
    run=_te_run,
    reference=_te_reference,
    compares="per-token loss [s, b] (fp32, 0 where the label is -100) and the full logits "
    "gradient [s, b, V] (all-gathered over TP)",
    reference_kind="torch.nn.functional.cross_entropy(ignore_index=-100, reduction='none') on "
    "the full logits, CPU, inputs upcast",
    parallel=(Parallel(), Parallel(tp=2), Parallel(tp=4)),
    edge_cases=(
        _te_edge(seed=1),
        _te_edge(ignored=0.0, seed=2),
        _te_edge(seq=8, vocab=512, logit_scale=10.0, seed=3),
        _te_edge(seq=1, batch=1, vocab=64, ignored=0.0, seed=4),
    ),
)
