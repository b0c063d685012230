"""Parity of the optimizer patches: fused AdamW, the fp16 unscale / inf check, the grad-norm and
the grad-clipping scale kernels.

Dtypes: every dtype a patched function accepts where Megatron can call it with that dtype, not
only Megatron's default.

* ``ADAMW``: fp32 *main* params by default, and bf16 params (a bf16 model whose optimizer
  config asks for no mixed precision is stepped directly by Megatron's FP32Optimizer, moments in
  the params' dtype). Not fp16: its moments underflow
  (``(1 - beta2) * g**2`` for a grad of 1e-4 is below fp16's smallest subnormal, in the stock
  optimizer too); Megatron keeps fp16 optimizer state only in TE's scaled FusedAdam
  (``PRECISION_AWARE_ADAMW``). The fp32 cells also compare the params' *update* on its own scale.
* ``PRECISION_AWARE_ADAMW``: TE FusedAdam's contract with ``--use-precision-aware-optimizer``:
  fp32, bf16 and fp16 params (the distributed optimizer's shards), master in fp32, fp16 or as
  bf16 + int16 remainders, moments in fp32, bf16 or fp16 (scaled), grads in fp32 or the params'
  dtype, optionally through a resume (the state dict, in TE's units, into a fresh optimizer);
  against torch.optim.AdamW in fp64, whose master is exact. fp32 cells keep fp32 states.
* ``GRAD_NORM``: the l2-norm kernel (amp_C ``multi_tensor_l2norm``) measures fp32 main grads,
  bf16 ``decoupled_grad`` (precision-aware optimizer) and 16-bit model params (Megatron's
  ``calc_params_l2_norm`` for ``--log-params-norm``): fp32, fp16 and bf16, with a 4096-element
  grad among them so an accumulation in 16 bits shows.
* ``GRAD_CLIP_SCALE``: ``clip_grad_by_total_norm_fp32`` takes fp32 grads and bf16
  ``decoupled_grad`` (it asserts those two), the scale kernel (amp_C ``multi_tensor_scale``)
  any of the three (``_multi_tensor_copy_this_to_that`` copies 16-bit model params through it):
  fp32, fp16 (kernel only) and bf16.
* ``UNSCALE_AND_CHECK`` only ever sees fp32 main grads (``main_grads_dtype`` is fp32 whenever a
  grad scaler exists): fp32.

Every reference here runs in fp64 whatever the tested dtype (:func:`_precision`), so a 16-bit
cell is judged against fp64, not the fp32 of the harness's default upcast; the benchmark (the
same reference in the tested dtype) is unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, Parallel, ParityCase
from megatron_npu.parity.cases._common import gather, generator, megatron_parallel

from megatron_npu.devices.facts import DEVICE_ORDER

_DEVICES = DEVICE_ORDER


def _dtypes(*names: str):
    import torch

    return {device: tuple(getattr(torch, n) for n in names) for device in _DEVICES}


_SHAPES = ((7,), (3, 5), (2, 3, 4), (1,), (16, 8))


def _precision(ctx: Context):
    """fp64 for the reference call (the harness's upcast dtype differs from the tested one),
    the tested dtype for the benchmark call and the run."""
    import torch

    return torch.float64 if ctx.dtype != ctx.tested_dtype else ctx.dtype


# ============================================================================ AdamW


def _adam_draws():
    """What both Adam cases draw: tensors, steps, the hyper-parameters, the grads' scale."""
    return {
        "tensors": st.integers(1, 5),
        "steps": st.integers(1, 4),
        # GPT pretraining rates (1e-4 .. 6e-4) and the larger ones of short fine-tunes
        "lr": st.sampled_from([1e-4, 3e-4, 1e-3, 1e-2]),
        "beta1": st.sampled_from([0.9, 0.8]),
        "beta2": st.sampled_from([0.999, 0.95]),
        "eps": st.sampled_from([1e-8, 1e-6]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
        "grad_scale": st.sampled_from([1.0, 1e-4]),
        "seed": st.integers(0, 2**16),
    }


def _adam_params():
    return st.fixed_dictionaries({**_adam_draws(), "amsgrad": st.booleans()})


def _adam_inputs(p):
    import torch

    g = generator(p)
    out = {}
    for i, shape in enumerate(_SHAPES[: p["tensors"]]):
        out[f"param{i}"] = torch.randn(*shape, generator=g, dtype=torch.float64)
        for step in range(p["steps"]):
            grad = torch.randn(*shape, generator=g, dtype=torch.float64) * p["grad_scale"]
            if step == 1:  # a step where some elements get no gradient at all
                grad = grad * (torch.rand(*shape, generator=g) < 0.7)
            out[f"grad{i}_{step}"] = grad
    return out


def _adam_steps(make_optimizer, ctx: Context, inputs):
    import torch

    p = ctx.params
    dtype = _precision(ctx)
    params = [
        torch.nn.Parameter(ctx.tensor(inputs[f"param{i}"]).to(dtype)) for i in range(p["tensors"])
    ]
    initial = torch.cat([ctx.value(inputs[f"param{i}"]).reshape(-1) for i in range(p["tensors"])])
    opt = make_optimizer(
        params,
        lr=p["lr"],
        betas=(p["beta1"], p["beta2"]),
        eps=p["eps"],
        weight_decay=p["weight_decay"],
        amsgrad=p["amsgrad"],
    )
    for step in range(p["steps"]):
        for i, param in enumerate(params):
            param.grad = ctx.tensor(inputs[f"grad{i}_{step}"]).to(dtype)
        opt.step()

    def flat(values):
        return torch.cat([v.detach().reshape(-1) for v in values])

    states = [opt.state[param] for param in params]
    out = {
        "params": flat(params),
        "exp_avg": flat(s["exp_avg"] for s in states),
        "exp_avg_sq": flat(s["exp_avg_sq"] for s in states),
    }
    if p["amsgrad"]:
        out["max_exp_avg_sq"] = flat(s["max_exp_avg_sq"] for s in states)
    if ctx.tested_dtype == torch.float32:
        # the parameters' change, exact in fp64, judged on its own scale: an update wrong by a
        # few per cent fails though it is ~1e-3 of the parameter. (A bf16 parameter rounds
        # away most of an update of lr ~1e-3, in the stock optimizer too: params only.)
        out["update"] = flat(params).cpu().double() - initial
    return out


def _adam_run(ctx: Context, inputs):
    import megatron.core.optimizer as megatron_optimizer

    return _adam_steps(megatron_optimizer.Adam, ctx, inputs)


def _adam_reference(ctx: Context, inputs):
    # ctx.original is what Megatron binds without apex/TE: torch.optim.AdamW
    return _adam_steps(ctx.original, ctx, inputs)


def _adam_edge(**kw):
    base = {
        "tensors": 5,
        "steps": 3,
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "amsgrad": False,
        "grad_scale": 1.0,
        "seed": 1,
    }
    base.update(kw)
    return base


ADAMW = ParityCase(
    name="adamw",
    params=_adam_params(),
    make_inputs=_adam_inputs,
    run=_adam_run,
    reference=_adam_reference,
    compares="params after the steps, exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad), "
    "each flattened over all params; fp32: the update (params after - before, in fp64)",
    reference_kind="ctx.original: torch.optim.AdamW (Megatron's fallback Adam) on CPU in fp64",
    dtypes=_dtypes("float32", "bfloat16"),
    edge_cases=(
        _adam_edge(),
        _adam_edge(amsgrad=True, steps=4, lr=1e-2, beta2=0.95, seed=2),
        _adam_edge(lr=1e-4, seed=5),  # a realistic pretraining rate: the update ~1e-4 of a param
        # tiny grads: the update is eps-dominated
        _adam_edge(grad_scale=1e-4, eps=1e-6, weight_decay=0.0, seed=3),
        _adam_edge(tensors=1, steps=1, seed=4),  # the first step: bias corrections 1-beta
    ),
)


# ============================================================================ precision-aware AdamW

#: how the optimizer keeps the master of a parameter: an fp32 copy, fp32 as the bf16 parameter
#: plus int16 remainders (bf16 parameters only; any other keeps an fp32 copy), an fp16 copy
_MASTERS = ("fp32", "fp32-remainders", "fp16")
_STATE_DTYPES = ("float32", "bfloat16", "float16")


def _precision_aware_params():
    return st.fixed_dictionaries(
        {
            **_adam_draws(),
            "master": st.sampled_from(_MASTERS),
            "exp_avg_dtype": st.sampled_from(_STATE_DTYPES),
            "exp_avg_sq_dtype": st.sampled_from(_STATE_DTYPES),
            # --main-grads-dtype: fp32 grads, or grads in the parameters' dtype
            "grads_in_param_dtype": st.booleans(),
            # the step after which the states go through a state dict into a fresh optimizer
            "resume_after": st.sampled_from([0, 1, 2]),
        }
    )


def _storage(ctx: Context) -> dict:
    """The drawn storage options. An fp32 cell keeps every state in fp32 (an fp32 model's
    shards; 16-bit states are the 16-bit cells' subject, judged there against the benchmark)."""
    import torch

    p = ctx.params
    if ctx.tested_dtype == torch.float32:
        return {"master": "fp32", "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    return {
        "master": p["master"],
        "exp_avg": getattr(torch, p["exp_avg_dtype"]),
        "exp_avg_sq": getattr(torch, p["exp_avg_sq_dtype"]),
    }


def _precision_aware_run(ctx: Context, inputs):
    """Megatron's factory call with --use-precision-aware-optimizer: TE FusedAdam's options on
    the 16-bit parameter shards, gradients in ``decoupled_grad``."""
    import megatron.core.optimizer as megatron_optimizer
    import torch

    from megatron_npu.optim.precision_aware import join_master

    p = ctx.params
    params = [torch.nn.Parameter(ctx.tensor(inputs[f"param{i}"])) for i in range(p["tensors"])]
    initial = torch.cat([ctx.value(inputs[f"param{i}"]).reshape(-1) for i in range(p["tensors"])])
    storage = _storage(ctx)

    def build():
        return megatron_optimizer.Adam(
            params,
            lr=p["lr"],
            betas=(p["beta1"], p["beta2"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            master_weights=True,
            master_weight_dtype=torch.float16 if storage["master"] == "fp16" else torch.float32,
            exp_avg_dtype=storage["exp_avg"],
            exp_avg_sq_dtype=storage["exp_avg_sq"],
            use_decoupled_grad=True,
            store_param_remainders=storage["master"] == "fp32-remainders",
        )

    opt = build()
    grad_dtype = ctx.dtype if p["grads_in_param_dtype"] else torch.float32
    for step in range(p["steps"]):
        for i, param in enumerate(params):
            param.decoupled_grad = ctx.tensor(inputs[f"grad{i}_{step}"]).to(grad_dtype)
        opt.step()
        opt.zero_grad()  # Megatron's: the decoupled grads go
        if step + 1 == p["resume_after"]:  # a resume: the state dict into a fresh optimizer
            saved = opt.state_dict()
            opt = build()
            opt.load_state_dict(saved)

    def master(param):
        stored = opt.get_unscaled_state(param, "master_param")
        return join_master(param.detach(), stored) if stored.dtype == torch.int16 else stored

    def flat(values):
        return torch.cat([v.detach().reshape(-1) for v in values])

    masters = flat(master(q) for q in params)
    out = {
        "params": flat(params),
        "master": masters,
        "exp_avg": flat(opt.get_unscaled_state(q, "exp_avg") for q in params),
        "exp_avg_sq": flat(opt.get_unscaled_state(q, "exp_avg_sq") for q in params),
    }
    if storage["master"] != "fp16":  # an fp16 master rounds a small update away, by design
        out["update"] = masters.cpu().double() - initial
    return out


def _stored(t, dtype):
    """``t`` as the contract stores a state of ``dtype``: rounded to bf16, scaled into fp16's
    range (one scale per tensor, absmax / (fp16 max / 2)) and rounded, or kept."""
    import torch

    if dtype == torch.bfloat16:
        return t.to(torch.bfloat16).to(t.dtype)
    if dtype == torch.float16:
        scale = t.abs().max() / (torch.finfo(torch.float16).max / 2)
        if scale == 0:
            return t
        return (t / scale).to(torch.float16).to(t.dtype) * scale
    return t


def _precision_aware_reference(ctx: Context, inputs):
    """torch.optim.AdamW on a master copy of the params: in fp64 for the reference (exact
    AdamW); for the benchmark TE's contract written plainly, computed in fp32 as TE's kernel
    does, with master and moments stored as the options ask after each step."""
    import torch

    p = ctx.params
    exact = ctx.dtype != ctx.tested_dtype
    compute = torch.float64 if exact else torch.float32
    masters = [
        torch.nn.Parameter(ctx.tensor(inputs[f"param{i}"]).to(compute)) for i in range(p["tensors"])
    ]
    initial = torch.cat([ctx.value(inputs[f"param{i}"]).reshape(-1) for i in range(p["tensors"])])
    opt = torch.optim.AdamW(
        masters,
        lr=p["lr"],
        betas=(p["beta1"], p["beta2"]),
        eps=p["eps"],
        weight_decay=p["weight_decay"],
    )
    grad_dtype = ctx.tested_dtype if p["grads_in_param_dtype"] else torch.float32
    storage = _storage(ctx)
    master_dtype = torch.float16 if storage["master"] == "fp16" else torch.float32
    for step in range(p["steps"]):
        for i, master in enumerate(masters):
            master.grad = ctx.tensor(inputs[f"grad{i}_{step}"]).to(grad_dtype).to(compute)
        opt.step()
        if exact:
            continue
        with torch.no_grad():
            for master in masters:
                master.copy_(_stored(master, master_dtype))
                for name in ("exp_avg", "exp_avg_sq"):
                    state = opt.state[master][name]
                    state.copy_(_stored(state, storage[name]))

    def flat(values):
        return torch.cat([v.detach().reshape(-1) for v in values])

    states = [opt.state[q] for q in masters]
    out = {
        "params": flat(m.to(ctx.dtype if exact else ctx.tested_dtype) for m in masters),
        "master": flat(masters),
        "exp_avg": flat(s["exp_avg"] for s in states),
        "exp_avg_sq": flat(s["exp_avg_sq"] for s in states),
    }
    if storage["master"] != "fp16":
        out["update"] = flat(masters).cpu().double() - initial
    return out


def _precision_aware_edge(**kw):
    base = {k: v for k, v in _adam_edge(seed=11).items() if k != "amsgrad"}
    base.update(
        master="fp32-remainders",
        exp_avg_dtype="float32",
        exp_avg_sq_dtype="float32",
        grads_in_param_dtype=False,
        resume_after=0,
    )
    base.update(kw)
    return base


PRECISION_AWARE_ADAMW = ParityCase(
    name="precision-aware-adamw",
    params=_precision_aware_params(),
    make_inputs=_adam_inputs,
    run=_precision_aware_run,
    reference=_precision_aware_reference,
    compares="params, the optimizer's master (fp32, fp16, or bf16 param + int16 remainders "
    "joined), exp_avg and exp_avg_sq unscaled to fp32, each flattened over all params; with "
    "an fp32 master the update (master after - before, in fp64)",
    reference_kind="torch.optim.AdamW on a master copy in fp64 on CPU (exact AdamW); the "
    "benchmark TE's contract in fp32, each state stored in its dtype after every step",
    dtypes=_dtypes("float32", "bfloat16", "float16"),
    edge_cases=(
        # Megatron's defaults with --bf16: fp32 states, master as bf16 + remainders
        _precision_aware_edge(),
        # the memory-saving recipe: bf16 grads and moments
        _precision_aware_edge(
            exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16", grads_in_param_dtype=True
        ),
        # fp16 scaled states everywhere, tiny grads (the scale keeps them out of underflow),
        # through a resume
        _precision_aware_edge(
            master="fp16",
            exp_avg_dtype="float16",
            exp_avg_sq_dtype="float16",
            grad_scale=1e-4,
            resume_after=1,
        ),
        _precision_aware_edge(exp_avg_dtype="bfloat16", resume_after=2),
        _precision_aware_edge(master="fp32", tensors=1, steps=1, lr=1e-2, seed=12),
    ),
)


# ============================================================================ unscale + inf check

_MAX_DP = 2


def _unscale_params():
    return st.fixed_dictionaries(
        {
            "tensors": st.integers(1, 5),
            "loss_scale": st.sampled_from([2.0**16, 1024.0, 3.0]),
            "plant": st.sampled_from(["none", "none", "inf", "-inf", "nan"]),
            "plant_rank": st.integers(0, _MAX_DP - 1),
            "seed": st.integers(0, 2**16),
        }
    )


def _unscale_inputs(p):
    import torch

    g = generator(p)
    out = {"inv_scale": torch.tensor([1.0 / p["loss_scale"]], dtype=torch.float64)}
    for rank in range(_MAX_DP):
        for i, shape in enumerate(_SHAPES[: p["tensors"]]):
            grad = torch.randn(*shape, generator=g, dtype=torch.float64) * p["loss_scale"]
            if p["plant"] != "none" and rank == p["plant_rank"] and i == p["tensors"] - 1:
                grad.view(-1)[-1] = float(p["plant"])
            out[f"grad{rank}_{i}"] = grad
    return out


class _StubOptimizer:
    """The attributes ``_unscale_main_grads_and_check_for_nan`` reads, nothing else."""

    def __init__(self, grads, inv_scale, group):
        import torch

        self._grads = grads
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=inv_scale.device)
        self.grad_scaler = SimpleNamespace(inv_scale=inv_scale)
        self.is_stub_optimizer = False
        self._group = group

    def _collect_main_grad_data_for_unscaling(self):
        return self._grads

    def get_grad_stats_parallel_group(self):
        return self._group


def _unscale_run(ctx: Context, inputs):
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    p = ctx.params
    with megatron_parallel():
        rank = dist.get_rank()
        grads = [ctx.tensor(inputs[f"grad{rank}_{i}"]) for i in range(p["tensors"])]
        # grad stats over the whole world, as the distributed optimizer reduces them
        stub = _StubOptimizer(grads, ctx.tensor(inputs["inv_scale"]), dist.group.WORLD)
        found = MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan(stub)
        flat = torch.cat([t.reshape(-1) for t in grads])
        return {
            "grads": gather(flat),
            "found_inf": gather(stub.found_inf.to(torch.int64)),
            "returned": gather(torch.tensor([int(found)], dtype=torch.int64)),
        }


def _unscale_reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    world = ctx.parallel.world
    inv = ctx.tensor(inputs["inv_scale"])
    per_rank = [
        torch.cat([ctx.tensor(inputs[f"grad{r}_{i}"]).reshape(-1) for i in range(p["tensors"])])
        for r in range(world)
    ]
    found = int(any(not bool(torch.isfinite(g).all()) for g in per_rank))
    flags = torch.full((world, 1), found, dtype=torch.int64)
    return {
        "grads": torch.stack([g * inv for g in per_rank]),
        "found_inf": flags,
        "returned": flags.clone(),
    }


def _unscale_edge(**kw):
    base = {"tensors": 5, "loss_scale": 2.0**16, "plant": "none", "plant_rank": 0, "seed": 1}
    base.update(kw)
    return base


UNSCALE_AND_CHECK = ParityCase(
    name="unscale-and-check",
    params=_unscale_params(),
    make_inputs=_unscale_inputs,
    run=_unscale_run,
    reference=_unscale_reference,
    compares="every rank's unscaled main grads (stacked), every rank's found_inf and returned "
    "flag (exact): an inf/nan on any rank must raise the flag on all of them",
    reference_kind="plain torch: grads * inv_scale in fp64, flag = any non-finite grad on any rank",
    dtypes=_dtypes("float32"),
    parallel=(Parallel(), Parallel(dp=2)),
    edge_cases=(
        _unscale_edge(),
        _unscale_edge(plant="inf", plant_rank=1, seed=2),  # only the other rank overflowed
        _unscale_edge(plant="nan", plant_rank=0, loss_scale=1024.0, seed=3),
        _unscale_edge(loss_scale=3.0, tensors=2, seed=4),  # inv_scale not a power of two
    ),
)


# ============================================================================ grad norm


#: the grad-norm case adds a 4096-element tensor: an accumulation in 16 bits goes wrong there
_NORM_SHAPES = (*_SHAPES, (64, 64))


def _norm_params():
    return st.fixed_dictionaries(
        {
            "tensors": st.integers(1, len(_NORM_SHAPES)),
            "scale": st.sampled_from([1.0, 1e-3, 50.0]),
            "seed": st.integers(0, 2**16),
        }
    )


_MAX_MP = 2


def _norm_inputs(p):
    import torch

    g = generator(p)
    return {
        f"grad{rank}_{i}": torch.randn(*shape, generator=g, dtype=torch.float64) * p["scale"]
        for rank in range(_MAX_MP)
        for i, shape in enumerate(_NORM_SHAPES[: p["tensors"]])
    }


def _norm_run(ctx: Context, inputs):
    import torch
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads

    p = ctx.params
    with megatron_parallel():
        rank = parallel_state.get_model_parallel_group().rank()
        grads = [ctx.tensor(inputs[f"grad{rank}_{i}"]) for i in range(p["tensors"])]
        # non-distributed optimizer: grad stats over the model-parallel group
        norm = clip_grads.get_grad_norm_fp32(
            grads, norm_type=2, grad_stats_parallel_group=parallel_state.get_model_parallel_group()
        )
        # the kernel's per-tensor norms, as amp_C returns them with per_tensor=True
        flag = torch.zeros(1, dtype=torch.int, device=ctx.device)
        _, per_tensor = clip_grads.multi_tensor_applier(
            clip_grads.l2_norm_impl, flag, [grads], True
        )
        group = parallel_state.get_model_parallel_group()
        return {
            "total_norm": torch.tensor([norm], dtype=torch.float32),
            "per_tensor_norms": gather(per_tensor.reshape(-1), group),
        }


def _norm_reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    dtype = _precision(ctx)
    world = ctx.parallel.tp * ctx.parallel.pp
    per = torch.stack(
        [
            torch.stack(
                [
                    torch.linalg.vector_norm(ctx.tensor(inputs[f"grad{r}_{i}"]).to(dtype))
                    for i in range(p["tensors"])
                ]
            )
            for r in range(world)
        ]
    )
    return {"total_norm": torch.linalg.vector_norm(per).reshape(1), "per_tensor_norms": per}


GRAD_NORM = ParityCase(
    name="grad-norm",
    params=_norm_params(),
    make_inputs=_norm_inputs,
    run=_norm_run,
    reference=_norm_reference,
    compares="total L2 norm from Megatron's get_grad_norm_fp32 (squared norms all-reduced over "
    "the model-parallel group) and each rank's per-tensor norms from l2_norm_impl",
    reference_kind="plain torch.linalg.vector_norm of every rank's grads on CPU in fp64",
    dtypes=_dtypes("float32", "float16", "bfloat16"),
    parallel=(Parallel(), Parallel(tp=2)),
    edge_cases=(
        {"tensors": len(_NORM_SHAPES), "scale": 1.0, "seed": 1},  # with the 4096-element grad
        {"tensors": 5, "scale": 1.0, "seed": 1},
        {"tensors": 1, "scale": 1e-3, "seed": 2},
        {"tensors": 3, "scale": 50.0, "seed": 3},
    ),
)


# ============================================================================ clip scale


def _clip_params():
    return st.fixed_dictionaries(
        {
            "tensors": st.integers(1, 5),
            "max_norm": st.sampled_from([0.5, 1.0, 1e3]),
            "plant_inf": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _clip_inputs(p):
    import torch

    g = generator(p)
    out = {}
    for i, shape in enumerate(_SHAPES[: p["tensors"]]):
        out[f"grad{i}"] = torch.randn(*shape, generator=g, dtype=torch.float64)
        out[f"src{i}"] = torch.randn(*shape, generator=g, dtype=torch.float64)
    if p["plant_inf"]:
        out[f"src{p['tensors'] - 1}"].view(-1)[0] = float("inf")
    out["scale"] = torch.rand(1, generator=g, dtype=torch.float64) + 0.25
    return out


def _clip_run(ctx: Context, inputs):
    import torch
    from megatron.core.optimizer import clip_grads

    p = ctx.params
    n = p["tensors"]
    out = _clip_kernel(ctx, inputs)
    if ctx.dtype == torch.float16:
        return out  # Megatron's clip asserts fp32 grads / bf16 decoupled grads
    decoupled = ctx.dtype == torch.bfloat16  # bf16 grads only arrive as decoupled_grad
    params = []
    for i in range(n):
        grad = ctx.tensor(inputs[f"grad{i}"])
        param = torch.nn.Parameter(torch.zeros_like(grad, dtype=torch.float32))
        if decoupled:
            param.decoupled_grad = grad
        else:
            param.grad = grad
        params.append(param)
    grads = [ctx.tensor(inputs[f"grad{i}"]) for i in range(n)]
    total = float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])))
    clip_grads.clip_grad_by_total_norm_fp32(
        params, p["max_norm"], total, use_decoupled_grad=decoupled
    )
    clipped = [q.decoupled_grad if decoupled else q.grad for q in params]
    return {"clipped_grads": torch.cat([c.reshape(-1) for c in clipped]), **out}


def _clip_kernel(ctx: Context, inputs):
    """The scale kernel itself: dst = src * scale into separate tensors, non-finite flag set."""
    import torch
    from megatron.core.optimizer import clip_grads

    src = [ctx.tensor(inputs[f"src{i}"]) for i in range(ctx.params["tensors"])]
    dst = [torch.empty_like(s) for s in src]
    flag = torch.zeros(1, dtype=torch.int, device=ctx.device)
    scale = float(ctx.tensor(inputs["scale"]))
    clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, flag, [src, dst], scale)
    return {
        "scaled": torch.cat([d.reshape(-1) for d in dst]),
        "overflow_flag": flag.to(torch.int64),
    }


def _clip_reference(ctx: Context, inputs):
    import torch

    p = ctx.params
    n = p["tensors"]
    dtype = _precision(ctx)
    grads = torch.cat([ctx.tensor(inputs[f"grad{i}"]).to(dtype).reshape(-1) for i in range(n)])
    total = float(torch.linalg.vector_norm(grads.double()))
    coeff = p["max_norm"] / (total + 1.0e-6)  # Megatron's clip_coeff
    src = torch.cat([ctx.tensor(inputs[f"src{i}"]).to(dtype).reshape(-1) for i in range(n)])
    out = {
        "scaled": src * float(ctx.tensor(inputs["scale"])),
        "overflow_flag": torch.tensor([int(not bool(torch.isfinite(src).all()))]),
    }
    if ctx.tested_dtype != torch.float16:
        out["clipped_grads"] = grads * coeff if coeff < 1.0 else grads
    return out


GRAD_CLIP_SCALE = ParityCase(
    name="grad-clip-scale",
    params=_clip_params(),
    make_inputs=_clip_inputs,
    run=_clip_run,
    reference=_clip_reference,
    compares="grads after clip_grad_by_total_norm_fp32 (fp32 .grad, or bf16 decoupled_grad; "
    "not fp16, which Megatron's clip refuses); "
    "multi_tensor_scale_impl's dst = src * scale and its non-finite flag (exact)",
    reference_kind="plain torch: Megatron's clip coefficient max_norm / (norm + 1e-6) applied in "
    "fp64 on CPU; flag = any non-finite src",
    dtypes=_dtypes("float32", "float16", "bfloat16"),
    edge_cases=(
        {"tensors": 5, "max_norm": 0.5, "plant_inf": False, "seed": 1},  # clips
        {"tensors": 3, "max_norm": 1e3, "plant_inf": True, "seed": 2},  # no clip; inf in src
    ),
)
