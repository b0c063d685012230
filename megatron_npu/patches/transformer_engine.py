"""Megatron's Transformer Engine layer spec without Transformer Engine.

Megatron-LM's default is ``--transformer-impl transformer_engine``. Without TE (every non-CUDA
device), ``megatron.core.extensions.transformer_engine`` binds its ``TE*`` names to placeholders
(``MagicMock`` objects; ``TENorm`` raises) and megatron-core's GPT spec module never binds
``TESpecProvider`` / ``TENorm`` (megatron-core < 0.17) or binds them to None (0.17+), so the spec
cannot be built. These entries put the stand-ins of :mod:`megatron_npu.modules.te_layers` in
place of the placeholders, and of every ``from ... import`` copy of them (the spec provider, the
model backends), and bind the GPT spec module's names and multi-latent attention's (None from
megatron-core 0.17). No module named ``transformer_engine`` is
ever installed or shadowed, and ``cuda`` is left alone: a GPU user with TE keeps TE.

The linear and attention stand-ins are built on the installed megatron-core's local layers the
first time the patches are applied (``kind="wrap"``: the builder ignores the placeholder it is
handed). The placeholders have no signature of their own to check against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron_npu.modules import te_layers
from megatron_npu.ops import gemm
from megatron_npu.patches.context_parallel import route_context_parallel
from megatron_npu.registry import Patch

_EXT = "megatron.core.extensions.transformer_engine"
_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
_PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"
_MLA = "megatron.core.transformer.multi_latent_attention"
_TESTS = "tests/patches/test_transformer_engine_spec.py::"
#: builds a TE-spec GPT and checks its parameter names and checkpoint keys
KEYS_TEST = _TESTS + "test_te_spec_model_has_te_parameter_names[LayerNorm]"


def _stand_in(name: str):
    def build(placeholder: Any) -> type:
        return te_layers.stand_in(name)

    build.__name__ = f"build_{name}"
    return build


class TESpecProvider:
    """megatron-core's own ``TESpecProvider``, where megatron-core binds it only when TE
    imports: calling this builds that class (which hands out the stand-ins)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.extensions.transformer_engine_spec_provider import (
            TESpecProvider as provider,
        )

        return provider(*args, **kwargs)


#: the Transformer Engine release whose behaviour the stand-ins reproduce, for megatron-core's
#: "is TE at least X?" questions in the spec provider (its fp8-free ``_extra_state`` format)
STAND_IN_TE_VERSION = "2.4.0"


def stand_in_te_min_version(version: str, check_equality: bool = True) -> bool:
    """megatron-core's ``is_te_min_version`` as the spec provider asks it without TE: whether the
    stand-ins reproduce TE ``version`` (no TE installed answers None > version, a TypeError up
    to megatron-core 0.16, "no" from 0.17)."""
    from packaging.version import Version

    have, want = Version(STAND_IN_TE_VERSION), Version(version)
    return have >= want if check_equality else have > want


def _te_final_norm(original: Any) -> Any:
    """A block of TE-spec layers ends in ``TENorm``, as it does in a process with TE (megatron-core
    picks the block's final norm from whether TE imports, not from the layer spec), so the
    checkpoint has TE's ``final_layernorm._extra_state`` too; a block of local-spec layers keeps
    megatron-core's choice."""

    @functools.wraps(original)
    def _get_block_submodules(*args: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer import transformer_block

        submodules = original(*args, **kwargs)
        fused_qkv = te_layers.stand_in("TELayerNormColumnParallelLinear")
        if submodules.layer_norm is transformer_block.LayerNormImpl and any(
            _linear_qkv(spec) is fused_qkv for spec in submodules.layer_specs
        ):
            return dataclasses.replace(submodules, layer_norm=te_layers.TENorm)
        return submodules

    return _get_block_submodules


def _linear_qkv(spec: Any) -> Any:
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    return getattr(getattr(attention, "submodules", None), "linear_qkv", None)


def _entry(key: str, name: str, reason: str, parity: str, benchmark: str, **extra: Any) -> Patch:
    return Patch(
        id=f"transformer-engine.{key}",
        target=f"{_EXT}.{name}",
        replacement=_stand_in(name),
        kind="wrap",
        check_signature=False,
        reason=reason,
        parity=f"megatron_npu.parity.cases.transformer_engine:{parity}",
        benchmark=benchmark,
        **extra,
    )


PATCHES = [
    Patch(
        id="transformer-engine.general-gemm",
        target=f"{_EXT}.te_general_gemm",
        replacement=gemm.te_general_gemm,
        check_signature=False,  # the target is None without TE
        rebind_copies=False,  # a None target: moe_utils' copy has its own entry
        reason="TE's GEMM into an output buffer: the linear layers' weight gradient under "
        "Megatron-FSDP (a 16-bit product kept in the fp32 gradient buffer)",
        versions=">=0.18",
        parity="megatron_npu.parity.cases.wgrad_accum:GRADIENT_ACCUMULATION_FUSION",
        benchmark_exempt="one weight-gradient GEMM per linear layer, the product the "
        "gradient-accumulation-fusion benchmark times",
    ),
    Patch(
        id="transformer-engine.norm",
        target=f"{_EXT}.TENorm",
        replacement=te_layers.TENorm,
        check_signature=False,
        reason="TE's LayerNorm/RMSNorm (q/k norms, final norm of the TE block spec) with TE's "
        "parameter names and _extra_state, through the adaptor's norm op",
        parity="megatron_npu.parity.cases.transformer_engine:TE_NORM",
        benchmark="perf.cases.layers:TE_NORM",
        npu_kernels=("npu_rms_norm",),
    ),
    _entry(
        "layernorm-column-parallel-linear",
        "TELayerNormColumnParallelLinear",
        "the input norm fused into QKV / FC1: TE's layer_norm_weight/_bias, weight, bias "
        "keys; the norm on the local sequence shard, then Megatron's column-parallel GEMM",
        "TE_LAYERNORM_COLUMN_PARALLEL_LINEAR",
        "perf.cases.layers:TE_LAYERNORM_LINEAR",
        npu_kernels=("npu_rms_norm",),
    ),
    _entry(
        "column-parallel-linear",
        "TEColumnParallelLinear",
        "TE's column-parallel linear on Megatron's ColumnParallelLinear, with _extra_state",
        "TE_COLUMN_PARALLEL_LINEAR",
        "perf.cases.layers:TE_COLUMN_LINEAR",
    ),
    _entry(
        "row-parallel-linear",
        "TERowParallelLinear",
        "TE's row-parallel linear on Megatron's RowParallelLinear, with _extra_state",
        "TE_ROW_PARALLEL_LINEAR",
        "perf.cases.layers:TE_ROW_LINEAR",
    ),
    _entry(
        "linear",
        "TELinear",
        "TE's plain linear: a TP-replicated weight (parallel_mode duplicated), or the "
        "column/row-parallel stand-in",
        "TE_LINEAR",
        "perf.cases.layers:TE_LINEAR",
    ),
    _entry(
        "dot-product-attention",
        "TEDotProductAttention",
        "TE's core attention on Megatron's DotProductAttention, so --use-flash-attn reaches "
        "the fused-attention op; _extra_state kept out of distributed checkpoints from 0.15",
        "TE_DOT_PRODUCT_ATTENTION",
        "perf.cases.attention:TE_DOT_PRODUCT_ATTENTION",
        npu_kernels=("npu_fusion_attention",),
    ),
    Patch(  # after the class above: it wraps that class's forward
        id="transformer-engine.context-parallel-attention",
        target=f"{_EXT}.TEDotProductAttention.forward",
        replacement=route_context_parallel,
        kind="wrap",
        reason="--context-parallel-size through TE's attention: ring (p2p), Ulysses (a2a) or "
        "all-gathered K/V over the context-parallel group, on the fused-attention op",
        parity="megatron_npu.parity.cases.context_parallel:TE_CONTEXT_PARALLEL_ATTENTION",
        benchmark_exempt="a context-parallel group needs several ranks, which a one-process "
        "benchmark cell does not have: perf/test_context_parallel_bench.py measures CP1 "
        "against CP2 training steps",
        npu_kernels=(
            "npu_fusion_attention",
            "npu_ring_attention_update",
            "npu_fusion_attention_grad",
        ),
    ),
    Patch(
        id="transformer-engine.block-final-norm",
        target="megatron.core.transformer.transformer_block._get_block_submodules",
        replacement=_te_final_norm,
        kind="wrap",
        reason="a block of TE-spec layers ends in TENorm, as in a process with TE: the final "
        "layernorm's checkpoint keys include TE's _extra_state",
        parity_exempt="chooses the final norm's class: TENorm has its own parity case",
        exempt_test=KEYS_TEST,
        benchmark_exempt="runs once while the model is built",
    ),
    Patch(
        id="transformer-engine.gpt-spec-provider",
        target=f"{_SPECS}.TESpecProvider",
        replacement=TESpecProvider,
        creates=True,
        check_signature=False,
        reason="the GPT spec builder's TESpecProvider, bound only when TE imports (None from "
        "megatron-core 0.17)",
        parity_exempt="binds a name, no numerics: the layers it hands out have parity cases",
        exempt_test=KEYS_TEST,
        benchmark_exempt="runs once while the spec is built",
    ),
    Patch(
        id="transformer-engine.gpt-spec-norm",
        target=f"{_SPECS}.TENorm",
        replacement=te_layers.TENorm,
        creates=True,
        check_signature=False,
        reason="the TE block spec's norm (get_gpt_decoder_block_spec), bound only when TE imports",
        parity_exempt="binds a name: TENorm has its own parity case",
        exempt_test=_TESTS + "test_te_block_spec_builds_with_te_norm",
        benchmark_exempt="runs once while the spec is built",
    ),
    *[
        Patch(
            id=f"transformer-engine.{key}" + ("" if module == _EXT else "-in-spec-provider"),
            target=f"{module}.{name}",
            replacement=getattr(te_layers, name),
            creates=True,
            check_signature=False,
            rebind_copies=False,
            reason=f"{what}: bound to None without TE, so the TE spec's MoE experts fall back "
            "to one GEMM per expert; the stand-in runs all local experts as one grouped GEMM "
            "(npu_grouped_matmul) with TE's per-expert parameter and checkpoint keys",
            parity="megatron_npu.parity.cases.moe:TE_GROUPED_LINEAR",
            benchmark="perf.cases.moe:TE_GROUPED_MLP",
            npu_kernels=("npu_grouped_matmul",),
        )
        for module in (_EXT, _PROVIDER)
        for key, name, what in (
            (
                "column-parallel-grouped-linear",
                "TEColumnParallelGroupedLinear",
                "the experts' grouped FC1 (--moe-grouped-gemm)",
            ),
            (
                "row-parallel-grouped-linear",
                "TERowParallelGroupedLinear",
                "the experts' grouped FC2 (--moe-grouped-gemm)",
            ),
        )
    ],
    *[
        Patch(
            id=f"transformer-engine.{key}-in-mla",
            target=f"{_MLA}.{name}",
            replacement=_stand_in(name),
            kind="wrap",
            check_signature=False,
            rebind_copies=False,  # the original is None: nothing else to rebind
            versions=">=0.17",
            reason="multi-latent attention tells its projections' kinds by comparing with its "
            "own TE names, None without TE from megatron-core 0.17: the stand-ins the TE spec "
            "hands it",
            parity_exempt="binds a name, no numerics: the stand-in has its own parity case",
            exempt_test="tests/megatron_lm/test_pretrain_gpt.py::"
            "test_multi_latent_attention_trains_as_megatrons_unfused_code",
            benchmark_exempt="read once while the model is built",
        )
        for key, name in (
            ("linear", "TELinear"),
            ("column-parallel-linear", "TEColumnParallelLinear"),
            ("layernorm-column-parallel-linear", "TELayerNormColumnParallelLinear"),
        )
    ],
    Patch(
        id="transformer-engine.spec-provider-te-version",
        target=f"{_PROVIDER}.is_te_min_version",
        replacement=stand_in_te_min_version,
        rebind_copies=False,
        reason="the TE spec's q/k norms are TENorm (not apex's FusedLayerNorm, picked for TE "
        "< 1.9) and its MoE experts without --moe-grouped-gemm TE's column/row linears (not the "
        "local ones, picked for TE < 1.7): megatron-core asks the TE version, which fails "
        "without TE up to 0.16 and answers 'older' from 0.17",
        parity_exempt="answers a version question, no numerics: the linears it selects have "
        "parity cases",
        exempt_test=_TESTS + "test_te_spec_moe_experts_are_te_linears",
        benchmark_exempt="runs once while the spec is built",
    ),
]
