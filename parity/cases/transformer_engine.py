"""Parity of the Transformer Engine stand-ins (:mod:`megatron_npu.modules.te_layers`).

Without TE, Megatron's ``TE*`` names are placeholders (``MagicMock`` objects, a ``TENorm`` that
raises), so ``ctx.original`` cannot be called. Every reference here is independent plain torch
in the upcast dtype on the CPU, written as Megatron's *local* spec computes the same layer:
``torch.nn.functional.layer_norm`` / ``rms_norm`` (WrappedTorchNorm's torch norms; zero-centred
gamma stored as ``w`` means weight ``1 + w``), ``x W^T + b`` (ColumnParallelLinear /
RowParallelLinear's GEMM) and ``softmax(Q K^T * scale + mask) V`` (DotProductAttention). The
run always builds the class the patch installed at ``megatron.core.extensions.transformer_engine``
(so a disabled patch leaves a placeholder there and the case fails).

Tensor parallelism (the linears, TP1 and TP2 on real gloo groups). Every rank holds its shard
exactly as Megatron shards it: column-parallel ``weight``/``bias`` rows (output features),
row-parallel ``weight`` columns and the matching slice of the input (``input_is_parallel``), a
replicated norm / duplicated weight. With ``sequence_parallel`` (drawn; it needs TP > 1 to
change any numerics) each rank gets its ``[s / tp, b, h]`` sequence shard; the column-parallel
GEMM all-gathers it and the row-parallel one reduce-scatters its output. Rank 0 returns full,
un-sharded tensors: outputs, input grads and sharded weight grads are all-gathered along their
sharded dim.

Replicated parameters (the norm's ``layer_norm_weight``/``_bias``, the row-parallel ``bias``,
the duplicated ``TELinear`` weights) get what Megatron's ``finalize_model_grads`` gives them:
under sequence parallelism each rank's gradient covers only its own sequence shard, and Megatron
sums them over the TP group for every parameter marked ``sequence_parallel``
(``_allreduce_non_tensor_model_parallel_grads``). The run does the same (a SUM all-reduce of the
marked parameters' grads when ``config.sequence_parallel``, each rank's own grad otherwise) and
is compared with the full-sequence gradient: a parameter left unmarked keeps rank 0's partial
gradient and fails. Without sequence parallelism every rank sees the whole sequence (the input
gradient is all-reduced), so rank 0's own gradient is the full one.

The 16-bit stage-2 benchmark runs the same reference in the tested dtype. It is structured like
the TP computation (per-output-shard GEMMs whose input-gradient contributions autograd sums, the
norm per sequence shard so its weight gradient is a sum of per-shard partial sums, per-input-
shard partial products summed for row parallelism), so the rounding of those partial sums,
which every TP implementation has, is in the benchmark too, and the column-parallel bias is
added to the GEMM's rounded result, as Megatron's linear function adds it (``TELinear``'s
duplicated GEMM takes its bias inside, ``F.linear``); in the upcast dtype the structure changes
nothing.

Attention runs with ``masked_softmax_fusion=False``: the fused softmax is its own patch (and
its own NPU kernel, ``softmax.fused``), so Megatron's unfused path here is its torch softmax and
the only kernel this case may reach is ``npu_fusion_attention`` (flash attention requested).

Structure: an integer ``structure`` tensor (compared exactly) holds one flag per expected
``state_dict`` key in TE's order (``layer_norm_weight``, ``layer_norm_bias`` for LayerNorm,
``weight``, ``bias``, ``_extra_state``; ``weight``, ``bias``, ``_extra_state`` for TENorm;
``_extra_state`` for the attention) and the number of keys, taken after the state dict has been
loaded back into the module (a checkpoint resume: ``set_extra_state`` must take what
``get_extra_state`` wrote; a load that fails adds a key). The linears also flag the keys of
their ``sharded_state_dict`` (the same entries), TELinear whether ``parallel_mode`` column / row
built the column- / row-parallel stand-in, and with sequence parallelism every parameter's
``sequence_parallel`` mark (set on the replicated ones, never on TP-sharded ones); the
attention counts its ``sharded_state_dict`` entries (none from megatron-core 0.15 on).
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, Parallel, ParityCase
from megatron_npu.parity.cases._common import (
    expected_key_flags,
    fused_attention_settings,
    gather,
    generator,
    grads,
    key_flags,
    megatron_config,
    megatron_parallel,
)

_EXT = "megatron.core.extensions.transformer_engine"
_MAX_TP = 2  # sizes that are split (sequence, sharded features) are multiples of this
_TP = (Parallel(), Parallel(tp=2))


def _te():
    import importlib

    return importlib.import_module(_EXT)


def _state_keys(module) -> list[str]:
    """The module's ``state_dict`` keys, after loading that state dict back into it (the path
    a checkpoint resume takes: ``set_extra_state`` must accept the ``_extra_state`` written)."""
    state = module.state_dict()
    try:
        module.load_state_dict(state)
    except Exception:  # noqa: BLE001 - judged by the exact comparison: one key too many
        return [*state, "<the state_dict does not load back>"]
    return list(state)


def _sharded_keys(module) -> list[str]:
    """The keys of the module's ``sharded_state_dict`` (distributed checkpoints), with the
    metadata a model hands its submodules (megatron-core 0.16)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return list(module.sharded_state_dict(metadata={"dp_cp_group": group}))


def _norm_reference(x, weight, bias, p, dtype):
    """Megatron's local-spec norm (WrappedTorchNorm: torch's LayerNorm / RMSNorm) of ``x``;
    ``weight`` is the stored parameter (``1 + weight`` with zero-centred gamma)."""
    import torch.nn.functional as F

    gamma = 1 + weight if p["zero_centered"] else weight
    if p["normalization"] == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), gamma.to(dtype), p["eps"])
    return F.layer_norm(x, (x.shape[-1],), gamma.to(dtype), bias, p["eps"])


def _stored_gamma(ctx: Context, gamma):
    """The norm weight as the module stores it: ``gamma - 1`` with zero-centred gamma."""
    return gamma - 1.0 if ctx.params["zero_centered"] else gamma


# =============================================================================== TENorm


def _norm_params():
    return st.fixed_dictionaries(
        {
            "normalization": st.sampled_from(["LayerNorm", "RMSNorm"]),
            "seq": st.integers(1, 16),
            "batch": st.integers(1, 3),
            # LayerNorm over fewer than 4 features is rounding noise (see cases/norm.py)
            "hidden": st.integers(4, 96),
            "scale": st.sampled_from([1.0, 30.0, 1e-3]),
            "eps": st.sampled_from([1e-5, 1e-6, 1e-2]),
            "zero_centered": st.booleans(),
            "sp": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _norm_inputs(p):
    import torch

    g = generator(p)
    shape = (p["seq"], p["batch"], p["hidden"])
    return {
        "x": torch.randn(*shape, generator=g, dtype=torch.float64) * p["scale"],
        "weight": 1 + 0.1 * torch.randn(p["hidden"], generator=g, dtype=torch.float64),
        "bias": 0.1 * torch.randn(p["hidden"], generator=g, dtype=torch.float64),
        "grad_out": torch.randn(*shape, generator=g, dtype=torch.float64),
    }


def _norm_keys(p) -> list[str]:
    return ["weight", *(["bias"] if p["normalization"] == "LayerNorm" else []), "_extra_state"]


def _norm_config(p, dtype):
    options = {}
    if p["zero_centered"]:
        options["layernorm_zero_centered_gamma"] = True
    if p["sp"]:  # the config wants a TP size for SP; the norm runs on one rank
        options.update(sequence_parallel=True, tensor_model_parallel_size=2, num_attention_heads=2)
    return megatron_config(
        hidden_size=p["hidden"],
        normalization=p["normalization"],
        layernorm_epsilon=p["eps"],
        params_dtype=dtype,
        **options,
    )


def _norm_run(ctx: Context, inputs):
    import torch

    p = ctx.params
    module = _te().TENorm(_norm_config(p, ctx.dtype), p["hidden"], eps=p["eps"])
    with torch.no_grad():
        module.weight.copy_(ctx.value(_stored_gamma(ctx, inputs["weight"])))
        if module.bias is not None:
            module.bias.copy_(ctx.value(inputs["bias"]))
    module.to(device=ctx.device, dtype=ctx.dtype)
    x = ctx.tensor(inputs["x"], grad=True)
    out = module(x)
    out.backward(ctx.tensor(inputs["grad_out"]).to(out.dtype))
    result = {"out": out, "grad_x": x.grad, "grad_weight": module.weight.grad}
    if p["normalization"] == "LayerNorm":
        result["grad_bias"] = module.bias.grad
    result["structure"] = key_flags(_state_keys(module), _norm_keys(p))
    if p["sp"]:
        result["sequence_parallel_marks"] = torch.tensor(
            [int(getattr(q, "sequence_parallel", False)) for q in module.parameters()]
        )
    return result


def _norm_reference_case(ctx: Context, inputs):
    import torch

    p = ctx.params
    layer_norm = p["normalization"] == "LayerNorm"
    x = ctx.tensor(inputs["x"], grad=True)
    w = ctx.tensor(_stored_gamma(ctx, inputs["weight"]), grad=True)
    b = ctx.tensor(inputs["bias"], grad=True) if layer_norm else None
    out = _norm_reference(x, w, b, p, ctx.dtype)
    result = {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), x=x, weight=w, bias=b)}
    result["structure"] = expected_key_flags(_norm_keys(p))
    if p["sp"]:
        result["sequence_parallel_marks"] = torch.ones(1 + int(layer_norm), dtype=torch.int64)
    return result


def _norm_edge(**kw):
    base = {
        "normalization": "RMSNorm",
        "seq": 4,
        "batch": 2,
        "hidden": 64,
        "scale": 1.0,
        "eps": 1e-5,
        "zero_centered": False,
        "sp": False,
        "seed": 1,
    }
    base.update(kw)
    return base


TE_NORM = ParityCase(
    name="te-norm",
    params=_norm_params(),
    make_inputs=_norm_inputs,
    run=_norm_run,
    reference=_norm_reference_case,
    compares="output, grads of input, weight (and bias for LayerNorm); the state_dict keys "
    "(weight, bias, _extra_state); with sequence parallelism the parameters' marks",
    reference_kind="torch layer_norm / rms_norm (Megatron's local-spec WrappedTorchNorm) on CPU, "
    "inputs upcast; zero-centred gamma as weight 1 + w",
    edge_cases=(
        _norm_edge(),
        _norm_edge(normalization="LayerNorm", seq=3, hidden=33, seed=2),
        _norm_edge(normalization="RMSNorm", scale=1e-3, eps=1e-6, seed=3),  # eps matters
        _norm_edge(normalization="LayerNorm", scale=1e-2, eps=1e-2, hidden=48, seed=4),
        _norm_edge(normalization="RMSNorm", zero_centered=True, hidden=32, seed=5),
        _norm_edge(normalization="LayerNorm", zero_centered=True, sp=True, hidden=24, seed=6),
        _norm_edge(normalization="RMSNorm", sp=True, seq=1, batch=1, hidden=8, seed=7),
    ),
)


# ============================================================================ the linears

_NORM_DRAWS = {
    "normalization": st.sampled_from(["LayerNorm", "RMSNorm"]),
    "zero_centered": st.booleans(),
    "eps": st.sampled_from([1e-5, 1e-6, 1e-2]),
}


def _linear_params(kind: str):
    draws = {
        "seq": st.integers(1, 6).map(lambda n: n * _MAX_TP),
        "batch": st.integers(1, 2),
        # the layer norm wants 4+ features (see TE_NORM); row parallelism splits them
        "fan_in": st.integers(2, 32).map(lambda n: n * _MAX_TP),
        "fan_out": st.integers(1, 24).map(lambda n: n * _MAX_TP),
        "bias": st.booleans(),
        "skip_bias_add": st.booleans(),
        "sp": st.booleans(),
        "scale": st.sampled_from([1.0, 10.0]),
        "seed": st.integers(0, 2**16),
    }
    if kind == "layernorm-column":
        draws.update(_NORM_DRAWS)
    if kind == "linear":
        draws["mode"] = st.sampled_from(["duplicated", "duplicated", None])
    return st.fixed_dictionaries(draws)


def _linear_inputs(p):
    import torch

    g = generator(p)
    s, b, i, o = p["seq"], p["batch"], p["fan_in"], p["fan_out"]
    return {
        "x": torch.randn(s, b, i, generator=g, dtype=torch.float64) * p.get("scale", 1.0),
        "weight": torch.randn(o, i, generator=g, dtype=torch.float64) / i**0.5,
        "bias": torch.randn(o, generator=g, dtype=torch.float64),
        "ln_weight": 1 + 0.1 * torch.randn(i, generator=g, dtype=torch.float64),
        "ln_bias": 0.1 * torch.randn(i, generator=g, dtype=torch.float64),
        "grad_out": torch.randn(s, b, o, generator=g, dtype=torch.float64),
    }


#: per kind: how the input / output are split over TP ("seq": the sequence shard under SP,
#: "features": the last dim, "full": replicated) and the dim each weight is sharded on (None:
#: replicated, gradient as finalize_model_grads leaves it)
_LAYOUT = {
    "layernorm-column": {"x": "seq", "out": "features", "weight": 0, "bias": 0},
    "column": {"x": "seq", "out": "features", "weight": 0, "bias": 0},
    "row": {"x": "features", "out": "seq", "weight": 1, "bias": None},
    "linear": {"x": "seq", "out": "seq", "weight": None, "bias": None},
}


def _mode(p, kind: str) -> str:
    """The stand-in a TELinear example builds: its parallel_mode, else the kind itself."""
    if kind == "linear":
        return {"column": "column", "row": "row"}.get(p["mode"], "linear")
    return kind


def _linear_keys(p, kind: str) -> list[str]:
    norm = []
    if kind == "layernorm-column":
        norm = ["layer_norm_weight"] + (
            ["layer_norm_bias"] if p["normalization"] == "LayerNorm" else []
        )
    return [*norm, "weight", *(["bias"] if p["bias"] else []), "_extra_state"]


def _linear_marks(p, kind: str) -> list[int]:
    """The sequence_parallel marks Megatron's finalize reads, per parameter (under SP): set on
    the replicated parameters, never on TP-sharded ones (their grads must not be summed)."""
    keys = [k for k in _linear_keys(p, kind) if k != "_extra_state"]
    layout = _LAYOUT[_mode(p, kind)]
    return [int(k.startswith("layer_norm") or layout.get(k) is None) for k in keys]


def _linear_config(p, tp: int, dtype, kind: str):
    sp = p["sp"]
    options = {}
    if kind == "layernorm-column":
        options.update(
            normalization=p["normalization"],
            layernorm_epsilon=p["eps"],
            layernorm_zero_centered_gamma=p["zero_centered"],
        )
    return megatron_config(
        hidden_size=p["fan_in"],
        num_attention_heads=2,
        params_dtype=dtype,
        sequence_parallel=sp,
        tensor_model_parallel_size=max(tp, 2) if sp else tp,
        **options,
    )


def _build_linear(p, kind: str, config):
    import torch

    te = _te()
    common = dict(
        config=config,
        init_method=torch.nn.init.zeros_,
        bias=p["bias"],
        skip_bias_add=p["skip_bias_add"],
        is_expert=False,
    )
    i, o = p["fan_in"], p["fan_out"]
    if kind == "layernorm-column":
        return te.TELayerNormColumnParallelLinear(i, o, gather_output=False, **common)
    if kind == "column":
        return te.TEColumnParallelLinear(i, o, gather_output=False, **common)
    if kind == "row":
        return te.TERowParallelLinear(i, o, input_is_parallel=True, **common)
    return te.TELinear(i, o, parallel_mode=p["mode"], skip_weight_param_allocation=False, **common)


def _split(t, how: str, tp: int, rank: int, sp: bool, dim_features: int = -1):
    if how == "features":
        return t.chunk(tp, dim=dim_features)[rank]
    if how == "seq" and sp:
        return t.chunk(tp, dim=0)[rank]
    return t


def _collect(t, how: str, group, sp: bool, dim_features: int = -1):
    """The full tensor from every rank's part of it (rank 0's own where it is replicated)."""
    if how == "features":
        return gather(t, group, dim=dim_features)
    if how == "seq" and sp:
        return gather(t, group, dim=0)
    return t.detach()


def _grad(param):
    """``param.grad``, zeros where none reached it (a parameter left out of the graph is then
    judged by the comparison, not a crash)."""
    import torch

    return param.grad.detach() if param.grad is not None else torch.zeros_like(param.detach())


def _finalized(param, config, group):
    """``param.grad`` as Megatron's finalize_model_grads leaves a replicated parameter's."""
    import torch.distributed as dist

    grad = _grad(param).clone()
    if config.sequence_parallel and getattr(param, "sequence_parallel", False):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(grad, group=group)
    return grad


def _linear_run(kind: str):
    def run(ctx: Context, inputs):
        import torch
        from megatron.core import parallel_state

        p = ctx.params
        with megatron_parallel():
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            group = parallel_state.get_tensor_model_parallel_group()
            config = _linear_config(p, tp, ctx.dtype, kind)
            module = _build_linear(p, kind, config)
            mode = _mode(p, kind)
            layout = _LAYOUT[mode]
            sp = p["sp"] and tp > 1
            with torch.no_grad():
                for name, master in (("weight", "weight"), ("bias", "bias")):
                    param = getattr(module, name, None)
                    if param is not None:
                        dim = layout[name]
                        full = (
                            inputs[master] if dim is None else inputs[master].chunk(tp, dim)[rank]
                        )
                        param.copy_(ctx.value(full))
                if mode == "layernorm-column":
                    module.layer_norm_weight.copy_(
                        ctx.value(_stored_gamma(ctx, inputs["ln_weight"]))
                    )
                    if module.layer_norm_bias is not None:
                        module.layer_norm_bias.copy_(ctx.value(inputs["ln_bias"]))
            module.to(device=ctx.device)
            x = ctx.tensor(_split(inputs["x"], layout["x"], tp, rank, sp).contiguous(), grad=True)
            out, out_bias = module(x)
            grad_out = _split(inputs["grad_out"], layout["out"], tp, rank, sp)
            loss = out + out_bias if out_bias is not None else out
            loss.backward(ctx.tensor(grad_out.contiguous()).to(out.dtype))
            result = {"out": _collect(out, layout["out"], group, sp)}
            if out_bias is not None:
                result["output_bias"] = _collect(
                    out_bias, "features" if layout["bias"] == 0 else "full", group, sp
                )
            result["grad_x"] = _collect(x.grad, layout["x"], group, sp)
            for name in ("weight", "bias"):
                param = getattr(module, name, None)
                if param is None:
                    continue
                dim = layout[name]
                result[f"grad_{name}"] = (
                    _finalized(param, config, group)
                    if dim is None
                    else gather(_grad(param), group, dim=dim)
                )
            if mode == "layernorm-column":
                result["grad_layer_norm_weight"] = _finalized(
                    module.layer_norm_weight, config, group
                )
                if module.layer_norm_bias is not None:
                    result["grad_layer_norm_bias"] = _finalized(
                        module.layer_norm_bias, config, group
                    )
            result["structure"] = _linear_structure(module, p, kind)
            return result

    return run


def _linear_structure(module, p, kind: str):
    import torch

    keys = _linear_keys(p, kind)
    # the distributed checkpoint holds the same entries (TP-sharded where the weight is)
    parts = [key_flags(_state_keys(module), keys), key_flags(_sharded_keys(module), keys)]
    if kind == "linear":  # the stand-in a TELinear of this parallel_mode builds
        te = _te()
        want = {"column": te.TEColumnParallelLinear, "row": te.TERowParallelLinear}.get(
            p["mode"], te.TELinear
        )
        parts.append(torch.tensor([int(type(module) is want)]))
    if p["sp"]:
        marks = [int(getattr(q, "sequence_parallel", False)) for q in module.parameters()]
        parts.append(torch.tensor(marks, dtype=torch.int64))
    return torch.cat(parts)


def _linear_reference(kind: str):
    def reference(ctx: Context, inputs):
        import torch
        import torch.nn.functional as F

        p = ctx.params
        tp = ctx.parallel.tp
        mode = _mode(p, kind)
        sp = p["sp"] and tp > 1
        x = ctx.tensor(inputs["x"], grad=True)
        w = ctx.tensor(inputs["weight"], grad=True)
        b = ctx.tensor(inputs["bias"], grad=True) if p["bias"] else None
        leaves = {"x": x, "weight": w, "bias": b}
        hidden = x
        if mode == "layernorm-column":
            lnw = ctx.tensor(_stored_gamma(ctx, inputs["ln_weight"]), grad=True)
            lnb = (
                ctx.tensor(inputs["ln_bias"], grad=True)
                if p["normalization"] == "LayerNorm"
                else None
            )
            leaves.update(layer_norm_weight=lnw, layer_norm_bias=lnb)
            # per sequence shard under SP: the norm's weight grads are sums of per-shard sums
            hidden = torch.cat(
                [
                    _norm_reference(xj, lnw, lnb, p, ctx.dtype)
                    for xj in x.chunk(tp if sp else 1, dim=0)
                ],
                dim=0,
            )
        add = None if p["skip_bias_add"] else b

        def per_rank(t, fn):
            # a replicated parameter used on each rank's sequence shard (SP, the output of a
            # row-parallel or duplicated linear): one use per shard, so its gradient is the
            # sum of per-shard partial sums, as finalize_model_grads sums them
            if sp and _LAYOUT[mode]["out"] == "seq":
                return torch.cat([fn(tj) for tj in t.chunk(tp, dim=0)], dim=0)
            return fn(t)

        if mode in ("layernorm-column", "column"):  # one GEMM per output shard
            out = torch.cat([F.linear(hidden, wk) for wk in w.chunk(tp, 0)], dim=-1)
            # the bias added to the GEMM's rounded result, as Megatron's linear function does
            out = out + add if add is not None else out
        elif mode == "row":  # partial products of the input shards, summed
            parts = [
                F.linear(xk, wk)
                for xk, wk in zip(hidden.chunk(tp, -1), w.chunk(tp, 1), strict=True)
            ]
            out = sum(parts[1:], parts[0])
            out = per_rank(out, lambda t: t + add) if add is not None else out
        else:
            out = per_rank(hidden, lambda t: F.linear(t, w, add))
        result = {"out": out}
        loss = out
        if p["skip_bias_add"] and b is not None:
            result["output_bias"] = b
            loss = per_rank(out, lambda t: t + b)
        result.update(grads(loss, ctx.tensor(inputs["grad_out"]), **leaves))
        result = {k: v.detach() for k, v in result.items()}
        keys = _linear_keys(p, kind)
        structure = [expected_key_flags(keys), expected_key_flags(keys)]
        if kind == "linear":
            structure.append(torch.ones(1, dtype=torch.int64))
        if p["sp"]:
            structure.append(torch.tensor(_linear_marks(p, kind), dtype=torch.int64))
        result["structure"] = torch.cat(structure)
        return result

    return reference


def _linear_edge(kind: str, **kw):
    base = {
        "seq": 8,
        "batch": 2,
        "fan_in": 32,
        "fan_out": 24,
        "bias": True,
        "skip_bias_add": False,
        "sp": False,
        "scale": 1.0,
        "seed": 1,
    }
    if kind == "layernorm-column":
        base.update(normalization="LayerNorm", zero_centered=False, eps=1e-5)
    if kind == "linear":
        base["mode"] = "duplicated"
    base.update(kw)
    return base


def _linear_case(kind: str, name: str, compares: str, edge_cases, parallel=_TP) -> ParityCase:
    return ParityCase(
        name=name,
        params=_linear_params(kind),
        make_inputs=_linear_inputs,
        run=_linear_run(kind),
        reference=_linear_reference(kind),
        compares=compares,
        reference_kind="plain torch x W^T + b (per TP shard) in the upcast dtype on CPU, as "
        "Megatron's local ColumnParallelLinear / RowParallelLinear compute it"
        + ("; the norm by torch layer_norm / rms_norm" if kind == "layernorm-column" else ""),
        parallel=parallel,
        edge_cases=tuple(edge_cases),
    )


_LN = "layernorm-column"
TE_LAYERNORM_COLUMN_PARALLEL_LINEAR = _linear_case(
    _LN,
    "te-layernorm-column-parallel-linear",
    "output [s, b, o] (all-gathered over TP), the bias handed back with skip_bias_add, grads of "
    "the input (all-gathered sequence under SP), weight and bias (all-gathered rows), "
    "layer_norm_weight / layer_norm_bias (summed over TP under SP, as finalize_model_grads "
    "does for sequence_parallel parameters); state_dict keys in TE's order and, under SP, the "
    "parameters' sequence_parallel marks",
    (
        _linear_edge(_LN),
        _linear_edge(_LN, normalization="RMSNorm", bias=False, seed=2),
        _linear_edge(_LN, normalization="RMSNorm", zero_centered=True, skip_bias_add=True, seed=3),
        _linear_edge(_LN, zero_centered=True, sp=True, seed=4),  # LayerNorm under SP
        _linear_edge(
            _LN, normalization="RMSNorm", sp=True, skip_bias_add=True, eps=1e-2, scale=10.0, seed=5
        ),
        _linear_edge(_LN, seq=2, batch=1, fan_in=4, fan_out=2, sp=True, bias=False, seed=6),
    ),
)
TE_COLUMN_PARALLEL_LINEAR = _linear_case(
    "column",
    "te-column-parallel-linear",
    "output (all-gathered over TP), the bias handed back with skip_bias_add, grads of the input "
    "(all-gathered sequence under SP), weight and bias (all-gathered rows); state_dict keys and, "
    "under SP, the sequence_parallel marks",
    (
        _linear_edge("column"),
        _linear_edge("column", bias=False, seed=2),
        _linear_edge("column", skip_bias_add=True, seed=3),
        _linear_edge("column", sp=True, seed=4),
        _linear_edge(
            "column", seq=2, batch=1, fan_in=2, fan_out=2, sp=True, skip_bias_add=True, seed=5
        ),
    ),
)
TE_ROW_PARALLEL_LINEAR = _linear_case(
    "row",
    "te-row-parallel-linear",
    "output (all-reduced over TP; reduce-scattered and all-gathered back under SP), the bias "
    "handed back with skip_bias_add, grads of the input (each rank's feature shard, "
    "all-gathered), weight (all-gathered columns) and bias (replicated; summed over TP under SP); "
    "state_dict keys and, under SP, the sequence_parallel marks",
    (
        _linear_edge("row"),
        _linear_edge("row", bias=False, seed=2),
        _linear_edge("row", skip_bias_add=True, seed=3),
        _linear_edge("row", sp=True, seed=4),
        _linear_edge(
            "row", seq=2, batch=1, fan_in=2, fan_out=2, sp=True, skip_bias_add=True, seed=5
        ),
    ),
)
TE_LINEAR = _linear_case(
    "linear",
    "te-linear",
    "TELinear(parallel_mode duplicated / None): output, the bias handed back with skip_bias_add, "
    "grads of the input, weight and bias (replicated: summed over TP under SP, as Megatron's "
    "finalize does for the sequence_parallel weights TE duplicates); parallel_mode column / row "
    "must build the column- / row-parallel stand-in (checked, and run as one); state_dict keys "
    "and, under SP, the sequence_parallel marks",
    (
        _linear_edge("linear"),
        _linear_edge("linear", mode=None, bias=False, seed=2),
        _linear_edge("linear", skip_bias_add=True, seed=3),
        _linear_edge("linear", sp=True, seed=4),
        _linear_edge("linear", mode="column", seed=5),
        _linear_edge("linear", mode="row", skip_bias_add=True, seed=6),
    ),
)


# ========================================================================== attention


def _attention_params():
    @st.composite
    def draw(d):
        heads = d(st.sampled_from([1, 2, 4]))
        return {
            "heads": heads,
            "groups": d(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])),
            "seq": d(st.integers(2, 32)),
            "batch": d(st.integers(1, 2)),
            "head_dim": (head_dim := d(st.sampled_from([8, 16, 32]))),
            # multi-latent attention's k_channels / v_channels: v heads narrower or wider
            "v_head_dim": d(st.sampled_from([head_dim, head_dim, head_dim // 2, head_dim + 8])),
            "mask": d(st.sampled_from(["causal", "causal", "padding", "none"])),
            "softmax_scale": d(st.sampled_from([None, 0.05, 0.3])),
            "qk_scale": d(st.sampled_from([1.0, 3.0])),
            "flash": d(st.booleans()),
            "seed": d(st.integers(0, 2**16)),
        }

    return draw()


def _attention_inputs(p):
    import torch

    g = generator(p)
    s, b, n, ng, d = p["seq"], p["batch"], p["heads"], p["groups"], p["head_dim"]
    dv = p["v_head_dim"]

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    # an arbitrary boolean mask (True = masked), every query keeping its own key so no row is
    # fully masked (a dead row has no defined softmax)
    mask = torch.rand(b, 1, s, s, generator=g) < 0.4
    mask &= ~torch.eye(s, dtype=torch.bool)
    return {
        "query": randn(s, b, n, d, scale=p["qk_scale"]),
        "key": randn(s, b, ng, d, scale=p["qk_scale"]),
        "value": randn(s, b, ng, dv),
        "grad_out": randn(s, b, n * dv),
        "mask": mask,
    }


def _attention_mask_type(p):
    from megatron.core.transformer.enums import AttnMaskType

    return {
        "causal": AttnMaskType.causal,
        "padding": AttnMaskType.padding,
        "none": AttnMaskType.no_mask,
    }[p["mask"]]


def _attention_run(ctx: Context, inputs):
    import torch

    p = ctx.params
    config = megatron_config(
        hidden_size=p["heads"] * p["head_dim"],
        num_attention_heads=p["heads"],
        num_query_groups=p["groups"],
        kv_channels=p["head_dim"],
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        params_dtype=ctx.dtype,
        fp16=ctx.dtype == torch.float16,
        bf16=ctx.dtype == torch.bfloat16,
    )
    mask_type = _attention_mask_type(p)
    # as MLASelfAttention builds it: q/k heads of k_channels, v heads of v_channels
    widths = (
        {"k_channels": p["head_dim"], "v_channels": p["v_head_dim"]}
        if p["v_head_dim"] != p["head_dim"]
        else {}
    )
    with megatron_parallel(), fused_attention_settings(use_flash_attn=p["flash"]):
        module = _te().TEDotProductAttention(
            config,
            layer_number=1,
            attn_mask_type=mask_type,
            attention_type="self",
            softmax_scale=p["softmax_scale"],
            **widths,
        )
        q, k, v = (ctx.tensor(inputs[n], grad=True) for n in ("query", "key", "value"))
        mask = inputs["mask"].to(ctx.device) if p["mask"] == "padding" else None
        out = module(q, k, v, mask, attn_mask_type=mask_type)
        result = {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), query=q, key=k, value=v)}
        # _extra_state in the state_dict; none of it in the sharded one (megatron-core 0.15+)
        result["structure"] = torch.cat(
            [
                key_flags(_state_keys(module), ["_extra_state"]),
                torch.tensor([len(_sharded_keys(module))]),
            ]
        )
    return result


def _attention_reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    s, n, ng, d = p["seq"], p["heads"], p["groups"], p["head_dim"]
    q, k, v = (ctx.tensor(inputs[n_], grad=True) for n_ in ("query", "key", "value"))
    kk, vv = (t.repeat_interleave(n // ng, dim=2) for t in (k, v))  # head h reads group h // (n/ng)
    scale = p["softmax_scale"] if p["softmax_scale"] is not None else d**-0.5
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) * scale
    if p["mask"] == "causal":
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    elif p["mask"] == "padding":
        scores = scores.masked_fill(inputs["mask"], float("-inf"))
    # the softmax in fp32 for 16-bit inputs, as Megatron's attention_softmax_in_fp32
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
    out = torch.einsum("bnst,tbnd->sbnd", probs.to(vv.dtype), vv)
    out = out.reshape(s, -1, n * p["v_head_dim"])
    result = {"out": out, **grads(out, ctx.tensor(inputs["grad_out"]), query=q, key=k, value=v)}
    result = {k_: t.detach() for k_, t in result.items()}
    # the state_dict holds _extra_state; the sharded one nothing from megatron-core 0.15 on
    # (TE's wrapper saved _extra_state there before)
    from packaging.version import Version

    from megatron_npu.patcher import megatron_core_version

    sharded = int(Version(megatron_core_version()) < Version("0.15"))
    result["structure"] = torch.cat([expected_key_flags(["_extra_state"]), torch.tensor([sharded])])
    return result


def _attention_edge(**kw):
    base = {
        "heads": 4,
        "groups": 2,
        "seq": 16,
        "batch": 2,
        "head_dim": 16,
        "mask": "causal",
        "softmax_scale": None,
        "qk_scale": 1.0,
        "flash": False,
        "seed": 1,
    }
    base.update(kw)
    base.setdefault("v_head_dim", base["head_dim"])  # value heads as wide as q/k unless asked
    return base


TE_DOT_PRODUCT_ATTENTION = ParityCase(
    name="te-dot-product-attention",
    params=_attention_params(),
    make_inputs=_attention_inputs,
    run=_attention_run,
    reference=_attention_reference,
    compares="context output [s, b, np*hn], grads of query, key and value (GQA: k/v of ng "
    "groups), on Megatron's unfused path and with flash attention requested (the fused op; "
    "npu_fusion_attention on the NPU); state_dict keys (_extra_state) and the number of "
    "sharded_state_dict entries (none)",
    reference_kind="independent softmax(Q K^T * scale, masked) V in the upcast dtype on CPU "
    "(softmax in fp32 at least), k/v heads repeated per query group, the default scale over "
    "the q/k head width",
    edge_cases=(
        _attention_edge(),  # unfused, causal, GQA 4/2
        _attention_edge(flash=True, seed=2),  # the fused op, causal
        _attention_edge(mask="padding", softmax_scale=0.3, seed=3),  # arbitrary boolean mask
        _attention_edge(mask="padding", flash=True, groups=1, seed=4),  # fused, MQA
        _attention_edge(mask="none", flash=True, heads=2, groups=2, softmax_scale=0.05, seed=5),
        _attention_edge(mask="none", heads=1, groups=1, seq=2, batch=1, head_dim=8, seed=6),
        _attention_edge(qk_scale=3.0, seq=32, head_dim=32, flash=True, seed=7),  # peaked scores
        # multi-latent attention: q/k heads wider than v (unfused), and narrower (the fused op)
        _attention_edge(head_dim=24, v_head_dim=16, seed=8),
        _attention_edge(v_head_dim=24, flash=True, mask="padding", seed=9),
    ),
)
