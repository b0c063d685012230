"""Parity of the mixture-of-experts entries: the router's gating GEMM, the grouped GEMM behind
``--moe-grouped-gemm`` (Megatron's legacy ``GroupedMLP`` through ``grouped_gemm.ops.gmm``) and the
Transformer Engine grouped linears of the TE spec's experts, and the token permutation of
``--moe-permute-fusion``.

Every reference is independent plain torch in the upcast dtype on the CPU: the gating logits
``x W^T (+ b)`` in the router dtype, and one ``x_g W_g`` per expert over the rows that expert
received (the loop Megatron's ``SequentialMLP`` runs), concatenated. Without the patches the
targets do not exist (``te_general_gemm``: a NameError up to megatron-core 0.16), are ``None``
(``grouped_gemm_util.ops``, the TE grouped linears) or lead elsewhere, so a disabled entry fails
its case.

The expert loads are drawn so that every branch of the grouped GEMM is reached: uneven loads,
empty experts (first, middle and last), a single expert holding every token, one expert only,
``trans_b`` both ways. The grouped linears add bias on and off and ``skip_bias_add`` (the bias
handed back per expert, as TE returns it for FC2), column- and row-parallel, and check their
``state_dict`` keys (``weight0`` ... ``bias0`` ... and one ``_extra_state``, loaded back as a
resume does) and their distributed-checkpoint keys (one ``_extra_state{i}`` per expert) exactly.

The permutation's routing maps are drawn in the four shapes the dispatchers hand over: every
token choosing top-k experts (the kernel path), tokens dropped without padding and a rank's
local experts only (rows select different numbers of experts: Megatron's unfused code), and
experts padded to a drawn capacity (the kernel's drop-and-pad mode); the probs go in with the
permute (alltoall), with the unpermute, or not at all. The reference is a loop over experts and
tokens in fp64.
"""

from __future__ import annotations

import inspect

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, ParityCase
from megatron_npu.parity.cases._common import (
    FP32_ONLY,
    build_from_spec,
    expected_key_flags,
    generator,
    grads,
    key_flags,
    megatron_config,
    megatron_parallel,
)

_EXT = "megatron.core.extensions.transformer_engine"
_UTILS = "megatron.core.transformer.moe.moe_utils"


def _module(name: str):
    import importlib

    return importlib.import_module(name)


def _loads(max_groups: int, max_rows: int):
    """Expert loads (tokens per expert): at least one token overall, empty experts drawn often."""
    return st.lists(
        st.one_of(st.just(0), st.integers(1, max_rows)), min_size=1, max_size=max_groups
    ).filter(lambda loads: sum(loads) > 0)


# ------------------------------------------------------------------------ router gating


def _router_takes_bias() -> bool:
    return "bias" in inspect.signature(_module(_UTILS).router_gating_linear).parameters


def _router_params():
    return st.fixed_dictionaries(
        {
            "tokens": st.integers(1, 24),
            "batch": st.sampled_from([None, 1, 2]),
            "hidden": st.integers(1, 48),
            "experts": st.integers(1, 16),
            "bias": st.booleans(),
            # fp32 is Megatron's --moe-router-dtype fp32; "input" routes in the input's dtype
            "router_dtype": st.sampled_from(["fp32", "input"]),
            "seed": st.integers(0, 2**16),
        }
    )


def _router_inputs(p):
    import torch

    g = generator(p)
    lead = (p["tokens"],) if p["batch"] is None else (p["tokens"], p["batch"])
    return {
        "x": torch.randn(*lead, p["hidden"], generator=g, dtype=torch.float64),
        "weight": torch.randn(p["experts"], p["hidden"], generator=g, dtype=torch.float64) * 0.2,
        "bias": torch.randn(p["experts"], generator=g, dtype=torch.float64),
        "grad_out": torch.randn(*lead, p["experts"], generator=g, dtype=torch.float64),
    }


def _router_dtype(ctx: Context):
    import torch

    return torch.float32 if ctx.params["router_dtype"] == "fp32" else ctx.dtype


def _router_run(ctx: Context, inputs):
    x = ctx.tensor(inputs["x"], grad=True)
    w = ctx.tensor(inputs["weight"], grad=True)
    use_bias = ctx.params["bias"] and _router_takes_bias()
    b = ctx.tensor(inputs["bias"], grad=True) if use_bias else None
    linear = _module(_UTILS).router_gating_linear
    dtype = _router_dtype(ctx)
    out = linear(x, w, b, dtype) if _router_takes_bias() else linear(x, w, dtype)
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, weight=w, bias=b)}


def _router_reference(ctx: Context, inputs):
    x = ctx.tensor(inputs["x"], grad=True)
    w = ctx.tensor(inputs["weight"], grad=True)
    b = (
        ctx.tensor(inputs["bias"], grad=True)
        if ctx.params["bias"] and _router_takes_bias()
        else None
    )
    out = x @ w.t()
    if b is not None:
        out = out + b
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, weight=w, bias=b)}


def _router_edge(**kw):
    base = {
        "tokens": 8,
        "batch": 2,
        "hidden": 32,
        "experts": 8,
        "bias": False,
        "router_dtype": "fp32",
        "seed": 1,
    }
    base.update(kw)
    return base


ROUTER_GATING = ParityCase(
    name="moe-router-gating",
    params=_router_params(),
    make_inputs=_router_inputs,
    run=_router_run,
    reference=_router_reference,
    compares="gating logits x W^T (+ b) in the router dtype; grads of x, W and b (Megatron's "
    "RouterGatingLinearFunction backward through te_general_gemm's NN / NT layouts)",
    reference_kind="independent torch matmul on CPU, inputs upcast",
    edge_cases=(
        _router_edge(),
        _router_edge(bias=True, router_dtype="input", seed=2),
        _router_edge(tokens=1, batch=None, hidden=1, experts=1, seed=3),
        _router_edge(tokens=24, batch=2, hidden=48, experts=16, bias=True, seed=4),
    ),
)


# -------------------------------------------------------------------------- grouped GEMM


def _gemm_params():
    return st.fixed_dictionaries(
        {
            "loads": _loads(6, 12),
            "k": st.integers(1, 32),
            "n": st.integers(1, 32),
            "trans_b": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _gemm_inputs(p):
    import torch

    g = generator(p)
    rows, groups = sum(p["loads"]), len(p["loads"])
    shape = (groups, p["n"], p["k"]) if p["trans_b"] else (groups, p["k"], p["n"])
    return {
        "x": torch.randn(rows, p["k"], generator=g, dtype=torch.float64),
        "weight": torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3,
        "grad_out": torch.randn(rows, p["n"], generator=g, dtype=torch.float64),
    }


def _gemm_run(ctx: Context, inputs):
    import torch

    gg = _module("megatron.core.transformer.moe.grouped_gemm_util")
    x = ctx.tensor(inputs["x"], grad=True)
    w = ctx.tensor(inputs["weight"], grad=True)
    sizes = torch.tensor(ctx.params["loads"], dtype=torch.int64)  # on the host, as Megatron's
    out = gg.ops.gmm(x, w, sizes, trans_b=ctx.params["trans_b"])
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, weight=w)}


def _per_expert(x, weights, loads, trans_b: bool):
    """One GEMM per expert over its rows (``SequentialMLP``'s loop), rows concatenated."""
    import torch

    parts, start = [], 0
    for g, load in enumerate(loads):
        w = weights[g].t() if trans_b else weights[g]
        parts.append(x[start : start + load] @ w)
        start += load
    return torch.cat(parts, dim=0)


def _gemm_reference(ctx: Context, inputs):
    x = ctx.tensor(inputs["x"], grad=True)
    w = ctx.tensor(inputs["weight"], grad=True)
    out = _per_expert(x, w, ctx.params["loads"], ctx.params["trans_b"])
    return {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, weight=w)}


def _gemm_edge(**kw):
    base = {"loads": [3, 5, 2, 6], "k": 16, "n": 24, "trans_b": False, "seed": 1}
    base.update(kw)
    return base


GROUPED_GEMM = ParityCase(
    name="moe-grouped-gemm",
    params=_gemm_params(),
    make_inputs=_gemm_inputs,
    run=_gemm_run,
    reference=_gemm_reference,
    compares="x_g W_g per expert over its rows; grads of x and of every expert's W (zero for an "
    "expert with no token)",
    reference_kind="independent per-expert torch matmul loop on CPU, inputs upcast",
    edge_cases=(
        _gemm_edge(),
        _gemm_edge(loads=[0, 7, 0, 4, 0], trans_b=True, seed=2),  # empty first, middle, last
        _gemm_edge(loads=[9], k=1, n=1, seed=3),  # one expert
        _gemm_edge(loads=[0, 0, 12, 0], k=32, n=8, seed=4),  # every token to one expert
    ),
)


# ------------------------------------------------------------------ TE grouped linears


def _linear_params():
    return st.fixed_dictionaries(
        {
            "loads": _loads(4, 10),
            "in": st.integers(1, 24),
            "out": st.integers(1, 24),
            "bias": st.booleans(),
            "skip_bias_add": st.booleans(),
            "parallel": st.sampled_from(["column", "row"]),
            "seed": st.integers(0, 2**16),
        }
    )


def _linear_inputs(p):
    import torch

    g = generator(p)
    rows, groups = sum(p["loads"]), len(p["loads"])
    return {
        "x": torch.randn(rows, p["in"], generator=g, dtype=torch.float64),
        "weight": torch.randn(groups, p["out"], p["in"], generator=g, dtype=torch.float64) * 0.3,
        "bias": torch.randn(groups, p["out"], generator=g, dtype=torch.float64),
        "grad_out": torch.randn(rows, p["out"], generator=g, dtype=torch.float64),
    }


def _linear_keys(p) -> list[str]:
    groups = len(p["loads"])
    keys = [f"weight{i}" for i in range(groups)]
    if p["bias"]:
        keys += [f"bias{i}" for i in range(groups)]
    return [*keys, "_extra_state"]


def _sharded_linear_keys(p) -> list[str]:
    groups = len(p["loads"])
    keys = []
    for i in range(groups):
        keys += [f"weight{i}", f"_extra_state{'' if i == 0 else i}"]
        if p["bias"]:
            keys.append(f"bias{i}")
    return keys


def _linear_run(ctx: Context, inputs):
    import torch

    p = ctx.params
    groups = len(p["loads"])
    name = (
        "TEColumnParallelGroupedLinear"
        if p["parallel"] == "column"
        else "TERowParallelGroupedLinear"
    )
    with megatron_parallel():
        config = megatron_config(params_dtype=ctx.dtype)
        module = getattr(_module(_EXT), name)(
            groups,
            p["in"],
            p["out"],
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=p["bias"],
            skip_bias_add=p["skip_bias_add"],
            is_expert=True,
        )
        with torch.no_grad():
            for i in range(groups):
                getattr(module, f"weight{i}").copy_(ctx.value(inputs["weight"][i]))
                if p["bias"]:
                    getattr(module, f"bias{i}").copy_(ctx.value(inputs["bias"][i]))
        module.to(device=ctx.device, dtype=ctx.dtype)
        x = ctx.tensor(inputs["x"], grad=True)
        out, bias_out = module(x, list(p["loads"]))
        out.backward(ctx.tensor(inputs["grad_out"]).to(out.dtype))
        result = {
            "out": out,
            "grad_x": x.grad,
            "grad_weight": torch.stack([getattr(module, f"weight{i}").grad for i in range(groups)]),
        }
        if p["bias"] and not p["skip_bias_add"]:
            result["grad_bias"] = torch.stack(
                [getattr(module, f"bias{i}").grad for i in range(groups)]
            )
        if bias_out is not None:
            result["bias_out"] = torch.stack([b.detach() for b in bias_out])
        state = module.state_dict()
        module.load_state_dict(state)
        result["structure"] = key_flags(list(state), _linear_keys(p))
        sharded = list(module.sharded_state_dict(metadata={"dp_cp_group": None}))
        result["sharded_structure"] = key_flags(sharded, _sharded_linear_keys(p))
    return result


def _linear_reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    x = ctx.tensor(inputs["x"], grad=True)
    w = ctx.tensor(inputs["weight"], grad=True)
    adds_bias = p["bias"] and not p["skip_bias_add"]
    b = ctx.tensor(inputs["bias"], grad=True) if adds_bias else None
    out = _per_expert(x, w, p["loads"], trans_b=True)
    if b is not None:
        out = out + torch.repeat_interleave(b, torch.tensor(p["loads"]), dim=0)
    result = {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, weight=w, bias=b)}
    if p["bias"] and p["skip_bias_add"]:
        result["bias_out"] = ctx.tensor(inputs["bias"])
    result["structure"] = expected_key_flags(_linear_keys(p))
    result["sharded_structure"] = expected_key_flags(_sharded_linear_keys(p))
    return result


def _linear_edge(**kw):
    base = {
        "loads": [3, 0, 5, 2],
        "in": 16,
        "out": 8,
        "bias": True,
        "skip_bias_add": False,
        "parallel": "column",
        "seed": 1,
    }
    base.update(kw)
    return base


TE_GROUPED_LINEAR = ParityCase(
    name="te-grouped-linear",
    params=_linear_params(),
    make_inputs=_linear_inputs,
    run=_linear_run,
    reference=_linear_reference,
    compares="x_g W_g^T (+ b_g) per expert; grads of x, every W_g and b_g; the bias handed back "
    "with skip_bias_add; state_dict and sharded_state_dict keys (exact)",
    reference_kind="independent per-expert torch matmul loop on CPU, inputs upcast",
    edge_cases=(
        _linear_edge(),
        _linear_edge(parallel="row", skip_bias_add=True, seed=2),  # FC2: bias handed back
        _linear_edge(loads=[0, 0, 7], bias=False, parallel="row", seed=3),
        _linear_edge(loads=[4], **{"in": 1, "out": 1}, seed=4),
    ),
)


# -------------------------------------------------------------------- token permutation

_ROUTINGS = ("topk", "dropped", "local", "pad")


def _permute_params():
    return st.fixed_dictionaries(
        {
            "tokens": st.integers(1, 16),
            "experts": st.integers(1, 8),
            "topk": st.integers(1, 8),
            "routing": st.sampled_from(_ROUTINGS),
            "capacity": st.integers(1, 16),
            "probs_at": st.sampled_from(["permute", "unpermute", "none"]),
            "hidden": st.integers(1, 16),
            "seed": st.integers(0, 2**16),
        }
    )


def _routing_map(p, g):
    """[tokens, experts] bool: top-k of random scores, then the drawn routing's changes."""
    import torch

    tokens, experts = p["tokens"], p["experts"]
    topk = min(p["topk"], experts)
    scores = torch.rand(tokens, experts, generator=g, dtype=torch.float64)
    chosen = torch.zeros(tokens, experts, dtype=torch.bool)
    chosen.scatter_(1, scores.topk(topk, dim=1).indices, True)
    if p["routing"] == "dropped":  # about a third of the choices dropped, token 0 keeps one
        keep = torch.rand(tokens, experts, generator=g) > 0.35
        keep[0] = True
        chosen &= keep
    if p["routing"] == "local":  # the columns of one rank's experts (the first half)
        chosen = chosen[:, : max(1, experts // 2)].contiguous()
    return chosen


def _permute_inputs(p):
    import torch

    g = generator(p)
    chosen = _routing_map(p, g)
    tokens, experts = chosen.shape
    rows = experts * min(p["capacity"], tokens) if p["routing"] == "pad" else int(chosen.sum())
    probs = torch.rand(tokens, experts, generator=g, dtype=torch.float64) * chosen
    return {
        "routing_map": chosen,
        "x": torch.randn(tokens, p["hidden"], generator=g, dtype=torch.float64),
        "probs": probs,
        # what the experts do to each permuted row (rows are in the same order on every path)
        "row_scale": torch.rand(rows, 1, generator=g, dtype=torch.float64) + 0.5,
        "grad_out": torch.randn(tokens, p["hidden"], generator=g, dtype=torch.float64),
    }


def _permute_run(ctx: Context, inputs):
    import torch

    p = ctx.params
    utils = _module(_UTILS)
    chosen = inputs["routing_map"].to(ctx.device)
    tokens, experts = chosen.shape
    pad = p["routing"] == "pad"
    x = ctx.tensor(inputs["x"], grad=True)
    probs = ctx.tensor(inputs["probs"], grad=True) if p["probs_at"] != "none" else None
    rows = inputs["row_scale"].shape[0]
    num_out = rows if pad else int(chosen.sum())
    permuted, permuted_probs, index_map = utils.permute(
        x,
        chosen,
        probs=probs if p["probs_at"] == "permute" else None,
        num_out_tokens=num_out,
        fused=True,
        drop_and_pad=pad,
    )[:3]
    y = permuted * ctx.tensor(inputs["row_scale"]).to(permuted.dtype)
    if permuted_probs is not None:
        y = y * permuted_probs.unsqueeze(-1).to(y.dtype)
    out = utils.unpermute(
        y,
        index_map,
        x.shape,
        probs=probs if p["probs_at"] == "unpermute" else None,
        routing_map=chosen,
        fused=True,
        drop_and_pad=pad,
    )
    result = {"permuted": permuted.detach(), "out": out}
    if permuted_probs is not None:
        result["permuted_probs"] = permuted_probs.detach()
    result.update(grads(out, ctx.tensor(inputs["grad_out"]), x=x, probs=probs))
    if probs is not None and result["grad_probs"] is None:  # the probs never reached the output
        result["grad_probs"] = torch.zeros_like(probs)
    return result


def _rows_of(chosen, capacity: int | None):
    """(token, expert) of each permuted row: experts in order, each expert's chosen tokens in
    order; with a capacity, each expert's first ``capacity`` of its chosen tokens followed by
    the others."""
    tokens, experts = chosen.shape
    rows = []
    for e in range(experts):
        mine = [t for t in range(tokens) if chosen[t, e]]
        if capacity is not None:
            mine = (mine + [t for t in range(tokens) if not chosen[t, e]])[:capacity]
        rows += [(t, e) for t in mine]
    return rows


def _permute_reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    chosen = inputs["routing_map"]
    tokens, _ = chosen.shape
    capacity = min(p["capacity"], tokens) if p["routing"] == "pad" else None
    rows = _rows_of(chosen, capacity)
    x = ctx.tensor(inputs["x"], grad=True)
    probs = ctx.tensor(inputs["probs"], grad=True) if p["probs_at"] != "none" else None
    scale = ctx.tensor(inputs["row_scale"])
    permuted = torch.stack([x[t] for t, _ in rows]) if rows else x[:0]
    out = torch.zeros_like(x)
    result = {"permuted": permuted.detach()}
    if p["probs_at"] == "permute":
        result["permuted_probs"] = torch.stack([probs[t, e] for t, e in rows]).detach()
    for i, (t, e) in enumerate(rows):
        weight = probs[t, e] if probs is not None else 1.0
        out = out.index_add(0, torch.tensor([t]), (x[t] * scale[i] * weight).unsqueeze(0))
    return {**result, "out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, probs=probs)}


def _permute_edge(**kw):
    base = {
        "tokens": 8,
        "experts": 4,
        "topk": 2,
        "routing": "topk",
        "capacity": 4,
        "probs_at": "permute",
        "hidden": 8,
        "seed": 1,
    }
    base.update(kw)
    return base


TOKEN_PERMUTATION = ParityCase(
    name="moe-token-permutation",
    params=_permute_params(),
    make_inputs=_permute_inputs,
    run=_permute_run,
    reference=_permute_reference,
    compares="the permuted rows and probs, the tokens summed back (weighted by the probs where "
    "the unpermute takes them); grads of the tokens and the probs",
    reference_kind="independent loop over experts and tokens on CPU, fp64",
    edge_cases=(
        _permute_edge(),
        _permute_edge(routing="pad", capacity=3, probs_at="unpermute", seed=2),
        _permute_edge(routing="dropped", probs_at="none", seed=3),
        _permute_edge(routing="local", topk=3, experts=6, seed=4),
        _permute_edge(tokens=1, experts=1, topk=1, hidden=1, seed=5),
        _permute_edge(routing="pad", capacity=8, probs_at="permute", seed=6),  # every token
    ),
)


# ------------------------------------------------------------------------- router top-k


def _top_k_params():
    return st.fixed_dictionaries(
        {
            "tokens": st.integers(1, 12),
            "groups": st.sampled_from([0, 2, 4]),  # 0: no group-limited routing
            "per_group": st.integers(2, 4),  # experts per group (the expert count without groups)
            "group_topk": st.integers(1, 4),
            "topk_per_group": st.integers(1, 3),  # Megatron's topk // group_topk
            "score_function": st.sampled_from(["sigmoid", "softmax"]),
            "use_pre_softmax": st.booleans(),
            "expert_bias": st.booleans(),
            "scaling_factor": st.sampled_from([None, 2.5]),
            "router_dtype": st.sampled_from(["fp32", "input"]),
            "seed": st.integers(0, 2**16),
        }
    )


def _top_k_setup(p) -> dict:
    """The routing the drawn parameters describe: (experts, topk, num_groups, group_topk)."""
    if p["groups"]:
        experts = p["groups"] * p["per_group"]
        group_topk = min(p["group_topk"], p["groups"])
        topk = group_topk * min(p["topk_per_group"], p["per_group"])
        return {
            "experts": experts,
            "topk": topk,
            "num_groups": p["groups"],
            "group_topk": group_topk,
        }
    experts = 2 * p["per_group"]
    return {
        "experts": experts,
        "topk": min(p["topk_per_group"], experts),
        "num_groups": None,
        "group_topk": None,
    }


def _top_k_inputs(p):
    import torch

    g = generator(p)
    s = _top_k_setup(p)
    tokens, experts = p["tokens"], s["experts"]
    # each row a shuffle of well-separated logits: every score stays distinct after rounding
    # to 16 bits, so the choice of experts is never a tie
    grid = torch.linspace(-3.0, 3.0, experts, dtype=torch.float64)
    rows = [grid[torch.randperm(experts, generator=g)] for _ in range(tokens)]
    logits = torch.stack(rows) + (torch.rand(tokens, experts, generator=g) - 0.5) * 0.05
    return {
        "logits": logits,
        "expert_bias": (torch.rand(experts, generator=g, dtype=torch.float64) - 0.5) * 0.3,
        "grad_out": torch.randn(tokens, experts, generator=g, dtype=torch.float64),
    }


def _top_k_run(ctx: Context, inputs):
    import torch

    p, s = ctx.params, _top_k_setup(ctx.params)
    logits = ctx.tensor(inputs["logits"], grad=True)
    routed = logits.float() if p["router_dtype"] == "fp32" else logits
    bias = inputs["expert_bias"].to(torch.float32).to(ctx.device) if p["expert_bias"] else None
    probs, routing_map = _module(_UTILS).topk_routing_with_score_function(
        routed,
        s["topk"],
        use_pre_softmax=p["use_pre_softmax"],
        num_groups=s["num_groups"],
        group_topk=s["group_topk"],
        scaling_factor=p["scaling_factor"],
        score_function=p["score_function"],
        expert_bias=bias,
        fused=True,
    )
    out = {"probs": probs, "routing_map": routing_map.to(torch.int64)}
    return {**out, **grads(probs, ctx.tensor(inputs["grad_out"]).to(probs.dtype), logits=logits)}


def _top_k_reference(ctx: Context, inputs):
    """Megatron's routing from its definition, in fp64: scores (sigmoid, or softmax before or
    after the choice), the choice by score plus bias among the best groups (a group scored by
    the sum of its best topk // group_topk), the chosen scores (sigmoid: over their sum when
    k > 1), times the scaling factor. The choice compares the scores as Megatron rounds them
    (to the logits' dtype), the weights are exact."""
    import torch

    p, s = ctx.params, _top_k_setup(ctx.params)
    logits = ctx.tensor(inputs["logits"], grad=True)
    rounded = torch.float32 if p["router_dtype"] == "fp32" else ctx.tested_dtype
    topk, experts = s["topk"], s["experts"]
    if p["score_function"] == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores.to(rounded).to(logits.dtype)
        if p["expert_bias"]:
            choice = choice + ctx.value(inputs["expert_bias"]).to(torch.float32).double()
    elif p["use_pre_softmax"]:
        scores = torch.softmax(logits, dim=-1)
        choice = scores.to(rounded).to(logits.dtype)
    else:
        scores, choice = logits, logits.detach().to(rounded).to(logits.dtype)
    choice = choice.detach()
    if s["num_groups"]:
        per_group = choice.view(choice.shape[0], s["num_groups"], -1)
        best = per_group.sort(dim=-1, descending=True).values[..., : topk // s["group_topk"]]
        kept = best.sum(dim=-1).topk(s["group_topk"], dim=-1).indices
        allowed = torch.zeros_like(best[..., 0], dtype=torch.bool).scatter(1, kept, True)
        choice = choice.masked_fill(
            ~allowed.repeat_interleave(experts // s["num_groups"], 1), float("-inf")
        )
    chosen = choice.topk(topk, dim=-1).indices
    weights = scores.gather(1, chosen)
    if p["score_function"] == "sigmoid" and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif p["score_function"] == "softmax" and not p["use_pre_softmax"]:
        weights = torch.softmax(weights, dim=-1)
    if p["scaling_factor"]:
        weights = weights * p["scaling_factor"]
    probs = torch.zeros_like(logits).scatter(1, chosen, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.int64).scatter(1, chosen, 1)
    out = {"probs": probs, "routing_map": routing_map}
    return {**out, **grads(probs, ctx.tensor(inputs["grad_out"]), logits=logits)}


def _top_k_edge(**kw):
    base = {
        "tokens": 8,
        "groups": 0,
        "per_group": 4,
        "group_topk": 1,
        "topk_per_group": 2,
        "score_function": "sigmoid",
        "use_pre_softmax": False,
        "expert_bias": True,
        "scaling_factor": 2.5,
        "router_dtype": "fp32",
        "seed": 1,
    }
    base.update(kw)
    return base


ROUTER_TOP_K = ParityCase(
    name="moe-router-top-k",
    params=_top_k_params(),
    make_inputs=_top_k_inputs,
    run=_top_k_run,
    reference=_top_k_reference,
    compares="routing probs and map [tokens, experts]; grad of the logits",
    reference_kind="independent fp64 routing from Megatron's definition on CPU",
    edge_cases=(
        _top_k_edge(),  # the kernel: sigmoid, bias, scaling, fp32 logits
        # DeepSeek-V3-like groups: 4 groups of 4, the best 2 groups, each scored by its best 2
        _top_k_edge(groups=4, group_topk=2, topk_per_group=2, seed=2),
        _top_k_edge(groups=2, group_topk=1, topk_per_group=1, expert_bias=False, seed=3),
        _top_k_edge(groups=2, group_topk=1, topk_per_group=3, seed=4),  # Megatron's code
        _top_k_edge(topk_per_group=1, seed=5),  # top-1: Megatron's code
        _top_k_edge(score_function="softmax", use_pre_softmax=True, seed=6),
        _top_k_edge(score_function="softmax", router_dtype="input", scaling_factor=None, seed=7),
        _top_k_edge(router_dtype="input", seed=8),  # 16-bit logits: Megatron's code
    ),
)


# ------------------------------------------------------------------------ the whole MoE layer


def _layer_params():
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 6),
            "batch": st.sampled_from([1, 2]),
            "hidden": st.sampled_from([8, 16]),
            "ffn": st.sampled_from([4, 8]),
            "experts": st.sampled_from([2, 4, 8]),
            "topk": st.sampled_from([1, 2, 8]),
            "score_function": st.sampled_from(["softmax", "sigmoid"]),
            # None: no token dropping; with a factor, the lowest-probability tokens over each
            # expert's capacity are dropped (Megatron's default policy), or the experts are padded
            "capacity_factor": st.sampled_from([None, 0.5, 1.0]),
            "pad": st.booleans(),
            "grouped": st.booleans(),  # the TE spec's grouped experts, else the local spec's loop
            "router_fusion": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _layer_setup(p) -> dict:
    topk = min(p["topk"], p["experts"])
    pad = p["pad"] and p["capacity_factor"] is not None
    # Megatron asks for the softmax before the choice when a token takes one expert
    pre_softmax = p["score_function"] == "softmax" and topk == 1
    return {"topk": topk, "pad": pad, "pre_softmax": pre_softmax}


def _layer_inputs(p):
    import torch

    g = generator(p)
    e, h, f = p["experts"], p["hidden"], p["ffn"]
    return {
        "x": torch.randn(p["seq"], p["batch"], h, generator=g, dtype=torch.float64),
        "router": torch.randn(e, h, generator=g, dtype=torch.float64) * 0.5,
        "fc1": torch.randn(e, 2 * f, h, generator=g, dtype=torch.float64) * 0.3,
        "fc2": torch.randn(e, h, f, generator=g, dtype=torch.float64) * 0.3,
        "grad_out": torch.randn(p["seq"], p["batch"], h, generator=g, dtype=torch.float64),
    }


def _expert_linears(layer, grouped: bool, e: int):
    """(fc1 weight, fc2 weight) of expert ``e``: TE's ``weight{e}`` of the grouped linears, or
    the local spec's per-expert MLP."""
    if grouped:
        return (
            getattr(layer.experts.linear_fc1, f"weight{e}"),
            getattr(layer.experts.linear_fc2, f"weight{e}"),
        )
    mlp = layer.experts.local_experts[e]
    return mlp.linear_fc1.weight, mlp.linear_fc2.weight


def _layer_run(ctx: Context, inputs):
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    p, s = ctx.params, _layer_setup(ctx.params)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    extra = {"moe_router_fusion": p["router_fusion"]} if "moe_router_fusion" in fields else {}
    with megatron_parallel():
        config = megatron_config(
            hidden_size=p["hidden"],
            ffn_hidden_size=p["ffn"],
            moe_ffn_hidden_size=p["ffn"],
            num_moe_experts=p["experts"],
            moe_router_topk=s["topk"],
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_score_function=p["score_function"],
            moe_router_pre_softmax=s["pre_softmax"],
            moe_router_dtype="fp32",
            moe_expert_capacity_factor=p["capacity_factor"],
            moe_pad_expert_input_to_capacity=s["pad"],
            moe_token_drop_policy="probs",
            moe_permute_fusion=True,
            moe_grouped_gemm=p["grouped"],
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            bias_activation_fusion=True,
            params_dtype=ctx.dtype,
            hidden_dropout=0.0,
            **extra,
        )
        if p["grouped"]:
            layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=p["experts"], moe_grouped_gemm=True
            )
        else:
            layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=p["experts"])
        layer = build_from_spec(layer_spec.submodules.mlp, config)
        layer.to(device=ctx.device, dtype=ctx.dtype).train()
        with torch.no_grad():
            layer.router.weight.copy_(ctx.value(inputs["router"]))
            for e in range(p["experts"]):
                fc1, fc2 = _expert_linears(layer, p["grouped"], e)
                fc1.copy_(ctx.value(inputs["fc1"][e]))
                fc2.copy_(ctx.value(inputs["fc2"][e]))
        x = ctx.tensor(inputs["x"], grad=True)
        out = layer(x)[0]
        out.backward(ctx.tensor(inputs["grad_out"]).to(out.dtype))

        def grad_of(param):
            return param.grad if param.grad is not None else torch.zeros_like(param)

        linears = [_expert_linears(layer, p["grouped"], e) for e in range(p["experts"])]
        return {
            "out": out.detach(),
            "grad_x": x.grad,
            "grad_router": grad_of(layer.router.weight),
            "grad_fc1": torch.stack([grad_of(fc1) for fc1, _ in linears]),
            "grad_fc2": torch.stack([grad_of(fc2) for _, fc2 in linears]),
        }


def _layer_reference(ctx: Context, inputs):
    """The MoE layer from its definition, per token: the router's scores of ``x W_r^T``, the top-k
    experts (softmax: of the logits, then a softmax over the chosen, or for top-1 the softmax
    over all experts at the chosen one; sigmoid: the chosen scores,
    over their sum when k > 1), each expert keeping at most its capacity of tokens by probability,
    and the sum of ``prob x W2 (silu(W1_gate x) * W1_up x)`` over the kept experts."""
    import math

    import torch
    import torch.nn.functional as F

    p, s = ctx.params, _layer_setup(ctx.params)
    x = ctx.tensor(inputs["x"], grad=True)
    wr = ctx.tensor(inputs["router"], grad=True)
    w1 = ctx.tensor(inputs["fc1"], grad=True)
    w2 = ctx.tensor(inputs["fc2"], grad=True)
    tokens = x.reshape(-1, p["hidden"])
    n, e, k = tokens.shape[0], p["experts"], s["topk"]
    logits = tokens @ wr.t()
    if s["pre_softmax"]:
        scores = torch.softmax(logits, dim=-1)
        chosen = scores.detach().topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
    elif p["score_function"] == "softmax":
        chosen = logits.detach().topk(k, dim=-1).indices
        weights = torch.softmax(logits.gather(1, chosen), dim=-1)
    else:
        scores = torch.sigmoid(logits)
        chosen = scores.detach().topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    probs = torch.zeros(n, e, dtype=logits.dtype).scatter(1, chosen, weights)
    keep = torch.zeros(n, e, dtype=torch.bool).scatter(1, chosen, True)
    if p["capacity_factor"] is not None:
        capacity = math.ceil(n * k / e * p["capacity_factor"])
        if capacity <= n:  # each expert keeps its `capacity` most probable tokens
            best = probs.detach().topk(capacity, dim=0).indices
            keep &= torch.zeros(n, e, dtype=torch.bool).scatter(0, best, True)
    out = torch.zeros_like(tokens)
    f = p["ffn"]
    for j in range(e):
        hidden = tokens @ w1[j].t()
        ffn = (F.silu(hidden[:, :f]) * hidden[:, f:]) @ w2[j].t()
        out = out + (probs[:, j] * keep[:, j]).unsqueeze(-1) * ffn
    out = out.view_as(x)
    result = {"out": out.detach()}
    result.update(grads(out, ctx.tensor(inputs["grad_out"]), x=x, router=wr, fc1=w1, fc2=w2))
    return result


def _layer_edge(**kw):
    base = {
        "seq": 4,
        "batch": 2,
        "hidden": 16,
        "ffn": 8,
        "experts": 4,
        "topk": 2,
        "score_function": "softmax",
        "capacity_factor": None,
        "pad": False,
        "grouped": False,
        "router_fusion": False,
        "seed": 1,
    }
    base.update(kw)
    return base


MOE_LAYER = ParityCase(
    name="moe-layer",
    params=_layer_params(),
    make_inputs=_layer_inputs,
    run=_layer_run,
    reference=_layer_reference,
    compares="the MoE layer's output (router, alltoall dispatch with the fused permutation, "
    "experts, combine); grads of the input, the router and every expert's FC1 / FC2",
    reference_kind="independent per-token routing and per-expert SwiGLU loop on CPU, fp64",
    whole_module=True,
    # fp32 only: a 16-bit layer rounds at every step between its kernels, and the definition run
    # in 16 bits is no trusted path to measure that against (msprobe's stage 2 wants the stock
    # path). Each 16-bit kernel of the layer is held to its stock path by its own case: the
    # router, the permutation, the grouped GEMM, the grouped linears.
    dtypes=FP32_ONLY,
    edge_cases=(
        _layer_edge(),
        _layer_edge(experts=8, topk=8, grouped=True, seed=2),  # every expert, grouped GEMM
        _layer_edge(score_function="sigmoid", router_fusion=True, capacity_factor=0.5, seed=13),
        _layer_edge(capacity_factor=0.5, pad=True, grouped=True, seed=4),  # padded experts
        _layer_edge(experts=2, topk=1, seq=1, batch=1, score_function="sigmoid", seed=5),
        _layer_edge(
            experts=8,
            topk=2,
            capacity_factor=1.0,
            router_fusion=True,
            score_function="sigmoid",
            seed=6,
        ),
    ),
)
