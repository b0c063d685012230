"""Mixture of Experts: the router's gating GEMM and the experts' grouped GEMMs.

``ROUTER_GATING``: Megatron's ``moe_utils.router_gating_linear`` (the router's logits, tokens x
experts, output in the router dtype, fp32), 4096 tokens (sequence 4096, batch 1), hidden 4096,
64 experts, inputs in the cell's dtype. ``megatron`` runs it with ``moe_utils.te_general_gemm``
set to None for the cell, Megatron's own fallback without Transformer Engine (``torch.mm`` in
the router dtype; the name is set for the whole cell because the backward reads it too, and the
adaptor's restore puts the module back). ``native`` runs it with the adaptor's
``general_gemm`` bound there. The GEMM is a plain matmul on every device, so no ``npu-binding``
path; both dtypes run, since either path casts to fp32 before the one GEMM.

``GROUPED_GEMM``: the grouped GEMM Megatron's legacy ``GroupedMLP`` calls as
``grouped_gemm.ops.gmm`` (its FC1: tokens permuted by expert [M, K] times ``w1`` viewed
[experts, K, N]). 8 local experts, 8192 tokens split unevenly with one expert receiving none,
K 4096, N 2 x 1408 (a gated FC1 of a Mixtral/DeepSeek-like expert). ``megatron`` is the
per-expert loop baseline, what Megatron runs without a grouped GEMM (``SequentialMLP``'s one
matmul per expert): ``torch.mm`` over ``torch.split(x, sizes)``, then ``torch.cat``.
``native`` / ``npu-binding`` call the ``gmm`` installed in ``grouped_gemm_util``
(``npu_grouped_matmul`` on the NPU). The patch applies to megatron-core < 0.17 only (the legacy
``GroupedMLP`` is gone from 0.17), so later releases have no such cells.

``TE_GROUPED_MLP``: the Transformer Engine grouped linears (``TEColumnParallelGroupedLinear``
FC1, ``TERowParallelGroupedLinear`` FC2, :mod:`megatron_npu.modules.te_layers`), which replace
``None`` without TE, so :func:`perf.case.implementation` has nothing to time on their
``megatron`` path. There that path is what Megatron builds for the experts without a grouped
GEMM: ``SequentialMLP``'s loop over experts, each expert's FC1 a stock ``ColumnParallelLinear``
and FC2 a ``RowParallelLinear`` (the local spec's expert linears, ``is_expert=True``).
``native`` / ``npu-binding`` run the FC1 and FC2 stand-ins installed under the cell's patch
module (Megatron's TE extension, or its spec provider), one grouped GEMM per layer. Both paths
run FC1 -> FC2 with no activation between (the activation is the same code on every path and
not what the layers replace), no bias (as MoE models are usually trained). 8 local experts, 8192
tokens split as above, hidden 4096, FFN 1408. The patches of FC1, FC2 and their spec-provider
twins all time this one two-layer block.

``TOKEN_PERMUTATION``: one MoE layer's token permutation as the alltoall dispatcher runs it:
``moe_utils.permute`` of the tokens and routing probs by a top-k routing map, then
``moe_utils.unpermute`` back to the tokens, forward and backward. ``megatron`` calls Megatron's
own functions with ``fused=False`` (its code without TE); ``native`` / ``npu-binding`` call the
installed ones with ``fused=True`` (Megatron's unfused code again on the CPU; the torch_npu
routing-map kernels on the NPU, one call each). 4096 tokens, hidden 4096, 64 experts, top-8.

``ROUTER_TOP_K``: the router's top-k (``moe_utils.topk_routing_with_score_function``) of
DeepSeek-V3-style routing, forward and backward: sigmoid scores of fp32 logits, expert bias,
256 experts in 8 groups of which 4 are kept (each scored by its best 2), top-8, scaling factor
2.5, 4096 tokens. ``megatron`` calls Megatron's function with ``fused=False``; ``native`` /
``npu-binding`` the installed one with ``fused=True`` (Megatron's unfused code again on the CPU,
``npu_moe_gating_top_k`` and its backward kernel on the NPU). fp32 only: the router's logits are
fp32 (``--moe-router-dtype fp32``) whatever the model's dtype.

``MOE_LAYER_STEP``: one MoE layer forward and backward, alltoall dispatch on one rank, 8
SwiGLU experts (FFN 1408), top-2, hidden 1024, 4096 tokens, no token dropping, softmax routing
with an fp32 router. ``megatron`` is what Megatron builds without TE: the local spec's
``SequentialMLP`` (one expert MLP after another) and the unfused permutation; ``native`` /
``npu-binding`` the TE spec's grouped experts (one grouped GEMM per layer and direction) with
``--moe-permute-fusion`` (the permute / unpermute kernels on the NPU). Both paths record MFU
with model FLOPs that count only the active experts (top-k x the expert FFN per token, SwiGLU's
three GEMMs, :func:`megatron_npu.training.flops.mlp_forward_flops`), as Megatron-LM counts an
MoE model; the router's small gating GEMM is left out, as there.

The GEMM cases (``GROUPED_GEMM``, ``TE_GROUPED_MLP``, ``MOE_LAYER_STEP``) run fp32 only: this CPU
has no bf16 matrix units (a bf16 GEMM runs about 100x slower than fp32, see ``perf/README.md``), so
a bf16 figure would time the emulation of bf16 arithmetic, not the op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from perf.case import BenchCase, Built, Cell, installed_of

_GEN_SEED = 0
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _randn(cell: Cell, *shape: int, seed: int = _GEN_SEED, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(cell.torch_dtype).requires_grad_()


def _expert_sizes(tokens: int, experts: int) -> list[int]:
    """Uneven tokens per expert, fixed for a shape: the second expert gets none (a routing that
    leaves an expert idle), the others shares 3..9 of 9 (as a router's load spread does)."""
    weights = [0 if e == 1 else 3 + (5 * e) % 7 for e in range(experts)]
    sizes = [tokens * w // sum(weights) for w in weights]
    sizes[0] += tokens - sum(sizes)
    return sizes


# ------------------------------------------------------------------------------- router gating


def _router_gating(cell: Cell) -> Built:
    import importlib

    moe_utils = importlib.import_module(_MOE_UTILS)
    s, b, h, e = (cell.shape[k] for k in ("seq", "batch", "hidden", "experts"))
    if cell.path == "megatron":  # Megatron's fallback, forward and backward (module docstring)
        moe_utils.te_general_gemm = None
    gating = moe_utils.router_gating_linear
    x, weight = _randn(cell, s, b, h), _randn(cell, e, h, seed=1, scale=0.02)
    if "bias" in inspect.signature(gating).parameters:
        return Built(lambda: gating(x, weight, None, torch.float32), (x, weight))
    return Built(lambda: gating(x, weight, torch.float32), (x, weight))


ROUTER_GATING = BenchCase(
    op="moe-router-gating",
    shapes={
        "full": {"seq": 4096, "batch": 1, "hidden": 4096, "experts": 64},
        "quick": {"seq": 256, "batch": 1, "hidden": 256, "experts": 8},
    },
    build=_router_gating,
    paths=("megatron", "native"),
    extra={"router_dtype": "float32"},
    note="megatron: router_gating_linear with te_general_gemm None (torch.mm in the router dtype); "
    "a plain matmul on every device, so no npu-binding path",
)


# -------------------------------------------------------------------------------- grouped GEMM


def _per_expert_loop(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The per-expert loop baseline: one ``torch.mm`` per expert's rows, concatenated. The
    weights are unbound once (one weight-gradient tensor in the backward, as SequentialMLP's
    separate expert weights give), not indexed per expert."""
    rows = torch.split(x, sizes, dim=0)
    return torch.cat([torch.mm(r, w) for r, w in zip(rows, weight.unbind(0), strict=True)], dim=0)


def _grouped_gemm(cell: Cell) -> Built:
    e, m, k, n = (cell.shape[key] for key in ("experts", "tokens", "fan_in", "fan_out"))
    sizes = _expert_sizes(m, e)
    x, weight = _randn(cell, m, k), _randn(cell, e, k, n, seed=1, scale=0.02)
    if cell.path == "megatron":
        return Built(lambda: _per_expert_loop(x, weight, sizes), (x, weight))
    gmm = installed_of(cell).gmm
    tokens_per_expert = torch.tensor(sizes)  # GroupedMLP hands gmm the counts as a CPU tensor
    return Built(lambda: gmm(x, weight, tokens_per_expert, trans_b=False), (x, weight))


_GEMM_NOTE = "fp32 only: this CPU has no bf16 matrix units (module docstring)"
GROUPED_GEMM = BenchCase(
    op="moe-grouped-gemm",
    shapes={
        "full": {"experts": 8, "tokens": 8192, "fan_in": 4096, "fan_out": 2 * 1408},
        "quick": {"experts": 4, "tokens": 256, "fan_in": 256, "fan_out": 2 * 128},
    },
    build=_grouped_gemm,
    dtypes=("float32",),
    note="megatron: the per-expert loop baseline (torch.mm per expert, torch.cat); megatron-core "
    f"< 0.17 only (the legacy GroupedMLP); {_GEMM_NOTE}",
)


# --------------------------------------------------------------------- TE grouped linears (MLP)


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.02)


def _te_grouped_mlp(cell: Cell) -> Built:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_npu import patcher
    from megatron_npu.registry import get_patch

    e, m, h, f = (cell.shape[key] for key in ("experts", "tokens", "hidden", "ffn"))
    sizes = _expert_sizes(m, e)
    model_parallel_cuda_manual_seed(0)  # the grouped linears initialise in the expert RNG fork
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=8,
        ffn_hidden_size=f,
        num_moe_experts=e,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=cell.torch_dtype,
    )
    common = dict(config=config, init_method=_init, bias=False, is_expert=True)
    x = _randn(cell, m, h)
    if cell.path == "megatron":
        forward, module = _sequential_mlp(common, e, h, f, sizes)
    else:
        owner, _ = patcher.resolve(get_patch(cell.patch_id).target)
        fc1 = owner.TEColumnParallelGroupedLinear(e, h, f, skip_bias_add=False, **common)
        fc2 = owner.TERowParallelGroupedLinear(e, f, h, skip_bias_add=True, **common)
        module = torch.nn.ModuleList([fc1, fc2])

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            return fc2(fc1(hidden, sizes)[0], sizes)[0]

    module.to(cell.torch_dtype)
    return Built(lambda: forward(x), (x, *module.parameters()))


def _sequential_mlp(
    common: dict, experts: int, hidden: int, ffn: int, sizes: list[int]
) -> tuple[Callable, torch.nn.Module]:
    """SequentialMLP's loop: each expert's stock ColumnParallelLinear FC1 and RowParallelLinear
    FC2 on its rows, the outputs concatenated."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    experts_fc = torch.nn.ModuleList(
        torch.nn.ModuleList(
            [
                ColumnParallelLinear(
                    hidden, ffn, gather_output=False, skip_bias_add=False, **common
                ),
                RowParallelLinear(
                    ffn, hidden, input_is_parallel=True, skip_bias_add=True, **common
                ),
            ]
        )
        for _ in range(experts)
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        outs = [
            fc2(fc1(rows)[0])[0]
            for (fc1, fc2), rows in zip(experts_fc, torch.split(x, sizes, dim=0), strict=True)
        ]
        return torch.cat(outs, dim=0)

    return forward, experts_fc


TE_GROUPED_MLP = BenchCase(
    op="te-grouped-mlp",
    shapes={
        "full": {"experts": 8, "tokens": 8192, "hidden": 4096, "ffn": 1408},
        "quick": {"experts": 4, "tokens": 256, "hidden": 256, "ffn": 128},
    },
    build=_te_grouped_mlp,
    dtypes=("float32",),
    note="FC1 -> FC2, no activation, no bias; megatron: SequentialMLP's per-expert "
    f"ColumnParallelLinear / RowParallelLinear loop; {_GEMM_NOTE}",
)


# ------------------------------------------------------------------------- token permutation


def _token_permutation(cell: Cell) -> Built:
    import importlib

    moe_utils = importlib.import_module(_MOE_UTILS)
    t, h, e, k = (cell.shape[key] for key in ("tokens", "hidden", "experts", "topk"))
    fused = cell.path != "megatron"
    permute, unpermute = moe_utils.permute, moe_utils.unpermute
    if not fused:  # Megatron's own functions, not the adaptor's wrappers around them
        permute = getattr(permute, "__wrapped__", permute)
        unpermute = getattr(unpermute, "__wrapped__", unpermute)
    x = _randn(cell, t, h)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(1))
    top = logits.topk(k, dim=1)
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(t, e).scatter(1, top.indices, top.values.softmax(-1))
    probs = probs.to(cell.torch_dtype).requires_grad_()

    def step() -> torch.Tensor:
        rows, row_probs, index_map = permute(
            x, routing_map, probs=probs, num_out_tokens=t * k, fused=fused
        )[:3]
        return unpermute(
            rows * row_probs.unsqueeze(-1), index_map, x.shape, routing_map=routing_map, fused=fused
        )

    return Built(step, (x, probs))


TOKEN_PERMUTATION = BenchCase(
    op="moe-token-permutation",
    shapes={
        "full": {"tokens": 4096, "hidden": 4096, "experts": 64, "topk": 8},
        "quick": {"tokens": 256, "hidden": 256, "experts": 8, "topk": 2},
    },
    build=_token_permutation,
    note="permute (tokens and probs) then unpermute, forward and backward; megatron: Megatron's "
    "functions with fused=False",
)


# ------------------------------------------------------------------------------- router top-k


def _router_top_k(cell: Cell) -> Built:
    import importlib

    moe_utils = importlib.import_module(_MOE_UTILS)
    t, e, k = (cell.shape[key] for key in ("tokens", "experts", "topk"))
    groups, group_topk = cell.shape["groups"], cell.shape["group_topk"]
    fused = cell.path != "megatron"
    route = moe_utils.topk_routing_with_score_function
    if not fused:  # Megatron's own function, not the adaptor's wrapper around it
        route = getattr(route, "__wrapped__", route)
    logits = _randn(cell, t, e)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(2)) * 0.01

    def step() -> torch.Tensor:
        return route(
            logits,
            k,
            num_groups=groups,
            group_topk=group_topk,
            scaling_factor=2.5,
            score_function="sigmoid",
            expert_bias=bias,
            fused=fused,
        )[0]

    return Built(step, (logits,))


ROUTER_TOP_K = BenchCase(
    op="moe-router-top-k",
    shapes={
        "full": {"tokens": 4096, "experts": 256, "topk": 8, "groups": 8, "group_topk": 4},
        "quick": {"tokens": 256, "experts": 16, "topk": 4, "groups": 4, "group_topk": 2},
    },
    build=_router_top_k,
    dtypes=("float32",),
    note="sigmoid, expert bias, group-limited top-k, scaling; megatron: Megatron's function "
    "with fused=False; fp32 logits only (--moe-router-dtype fp32)",
)


# ------------------------------------------------------------------------- one MoE layer step


def _moe_layer_step(cell: Cell) -> Built:
    import torch.nn.functional as F
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_npu.parity.cases._common import build_from_spec

    from megatron_npu.training import flops

    e, k, t, h, f = (cell.shape[key] for key in ("experts", "topk", "tokens", "hidden", "ffn"))
    adaptor = cell.path != "megatron"
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=8,
        ffn_hidden_size=f,
        moe_ffn_hidden_size=f,
        num_moe_experts=e,
        moe_router_topk=k,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        moe_grouped_gemm=adaptor,
        moe_permute_fusion=adaptor,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=True,
        use_cpu_initialization=True,
        params_dtype=cell.torch_dtype,
    )
    if adaptor:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=e, moe_grouped_gemm=True
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=e)
    layer = build_from_spec(spec.submodules.mlp, config).to(cell.torch_dtype).train()
    x = _randn(cell, t, 1, h)
    active = flops.active_ffn_hidden_size(
        f, num_experts=e, moe_ffn_hidden_size=f, moe_router_topk=k
    )
    return Built(
        lambda: layer(x)[0],
        (x, *layer.parameters()),
        forward_flops=flops.mlp_forward_flops(t, h, active, swiglu=True),
    )


MOE_LAYER_STEP = BenchCase(
    op="moe-layer-step",
    shapes={
        "full": {"experts": 8, "topk": 2, "tokens": 4096, "hidden": 1024, "ffn": 1408},
        "quick": {"experts": 4, "topk": 2, "tokens": 128, "hidden": 64, "ffn": 64},
    },
    build=_moe_layer_step,
    dtypes=("float32",),
    note="one MoE layer fwd+bwd, alltoall on one rank; megatron: SequentialMLP and the unfused "
    f"permutation; the adaptor: grouped experts and the fused permutation; {_GEMM_NOTE}",
)
