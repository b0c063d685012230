"""The GPT model: Megatron-Core's ``GPTModel`` on the local or the Transformer Engine layer spec,
one chunk per virtual stage.

Initial weights
---------------
By default the weights are Megatron-LM's: ``pretrain_gpt.py``'s model provider with the same
options draws the same values (megatron-core's own init methods, from the generators Megatron-LM
seeds: ``seed + 100 * pp_rank``), so ``train`` and the script start from the same model and, in
fp32 on cpu, give the same losses at every step
(``tests/megatron_lm/test_train_is_megatron_lm.py``). Those weights depend on the layout. With
``use_cpu_initialization=True`` each tensor-parallel weight is built whole on every rank by
``_initialize_affine_weight_cpu`` (the master weight, drawn from the CPU generator) and each TP rank
copies out its slices -- so TP and DP layouts agree; by default (the device path) each TP rank draws
its own shard. Pipeline layouts never agree: the CPU generator is consumed layer after layer, so the
first layer built on stage 1 of a PP2 run draws from where the PP1 run's layer 1 left off, not from
where its layer ``L/2 + 1`` did; and Megatron-LM also seeds each stage with
``seed + 100 * pp_rank``.

``--layout-independent-init`` makes every TP/PP/DP/EP layout, and every device, start from the
same global weights, so that a TP2 or PP2 run is the TP1 PP1 run computed differently (what a
layout comparison needs; the default compare matrix sets it).
With it, this module re-seeds the init stream (:mod:`~megatron_npu.training.weight_init`, and the
CPU generator) before each piece is built, from the run seed and
the piece's *global* identity:

* before each model chunk: ``(seed, "model")`` -- the embedding, built first on the first stage,
  draws from the same state in every layout;
* before each transformer layer: ``(seed, "layer", global_layer_number)`` via
  :class:`SeededTransformerLayer`, the local spec's ``TransformerLayer`` with this one addition;
* the output layer (untied embeddings) is built right after the last layer, so it draws from the
  state the last layer left, the same in every layout; tied output weights are copied from the
  embedding by Megatron itself.

Mixture-of-experts layers (``--num-experts``) are seeded the same way one level down: each
expert's weights from ``(seed, "layer", global_layer_number, "expert", global_expert_index)``,
so an EP2 rank holding experts 2 and 3 draws what the EP1 run draws for them; the shared expert
from ``(..., "shared-expert")``; and what follows an MoE layer from ``(..., "after")``, so the
output layer does not depend on how many experts the rank built. Experts split by expert tensor
parallelism are cut by their expert-TP rank (:func:`~megatron_npu.training.weight_init.expert`).
This covers the experts that build one module per expert (``SequentialMLP``: the local spec,
and the TE spec without ``--moe-grouped-gemm``); the grouped experts draw their local experts
in one loop.

The CPU generator state from before the build is put back afterwards, so dropout streams do not
depend on how much the build consumed. ``tests/training`` checks the outcome: the first ten
losses of TP2, TP2+SP, PP2, PP2 interleaved, DP2 and TP2 PP2 equal those of TP1 PP1.

Where the weights are built is ``--use-cpu-initialization`` (Megatron's host path) or, by default,
the device (Megatron's device path); with ``--layout-independent-init``,
:mod:`megatron_npu.training.weight_init` makes both draw the same values from one CPU stream, so
the choice changes memory, not the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
from argparse import Namespace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import transformer_block
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

from megatron_npu import console
from megatron_npu.devices.base import Device
from megatron_npu.moe_options import moe_layer_pattern
from megatron_npu.training import weight_init

#: Megatron-LM's ``_set_random_seed`` gives each pipeline stage its own seed.
PP_SEED_STRIDE = 100


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a name (stable across processes and platforms)."""
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


_OFFSET_TAKES_PP_RANK = "pp_rank" in inspect.signature(get_transformer_layer_offset).parameters


class SeededTransformerLayer(TransformerLayer):
    """``TransformerLayer`` that seeds the CPU generator from its global layer number first.

    The seed is ``derived_seed(config.init_seed, "layer", global_layer_number)``, so a layer's
    initial weights do not depend on which pipeline stage or virtual chunk builds it.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        **groups_and_stage,  # pg_collection (0.15+) or model_comm_pgs (0.13/0.14), vp_stage
    ):
        groups = groups_and_stage.get("pg_collection") or groups_and_stage.get("model_comm_pgs")
        pp_rank = (
            get_pg_rank(groups.pp)
            if groups is not None
            else parallel_state.get_pipeline_model_parallel_rank()
        )
        vp_stage = groups_and_stage.get("vp_stage")
        if _OFFSET_TAKES_PP_RANK:
            offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        else:  # megatron-core < 0.15 reads the pipeline rank from parallel_state itself
            offset = get_transformer_layer_offset(config, vp_stage)
        global_number = layer_number + offset
        seed = getattr(config, "init_seed", None)
        if seed is not None:
            weight_init.reseed(derived_seed(seed, "layer", global_number))
        _building.update(layer=global_number, experts=0)
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            hidden_dropout=hidden_dropout,
            **groups_and_stage,
        )
        if seed is not None and getattr(config, "num_moe_experts", None):
            weight_init.reseed(derived_seed(seed, "layer", global_number, "after"))


#: the layer being built (global number) and how many of its local experts exist so far
_building: dict[str, int] = {"layer": 0, "experts": 0}


def _expert_seed(config: TransformerConfig, part: str) -> int | None:
    seed = getattr(config, "init_seed", None)
    if seed is None:
        return None
    if part == "shared-expert":
        return derived_seed(seed, "layer", _building["layer"], part)
    local = config.num_moe_experts // config.expert_model_parallel_size
    index = parallel_state.get_expert_model_parallel_rank() * local + _building["experts"]
    _building["experts"] += 1
    return derived_seed(seed, "layer", _building["layer"], "expert", index)


def _building_in(cls: type, prefix: str, context: Any) -> type:
    """``cls`` whose construction runs inside ``context(config)`` (the ``config`` it is built
    with, or None): one way for every seeded or gated module below."""

    def __init__(self, *args, **kwargs):
        with context(kwargs.get("config", args[0] if args else None)):
            cls.__init__(self, *args, **kwargs)

    return type(f"{prefix}{cls.__name__}", (cls,), {"__init__": __init__})


def _seeded_expert_linear(cls: type, first: bool) -> type:
    """``cls`` (an expert's FC1 or FC2) drawing its weights as an expert; FC1 starts the expert's
    stream at its global index (and is cut as a gated FC1 with ``--swiglu``), FC2 continues."""

    @contextlib.contextmanager
    def as_expert(config: Any):
        seed = _expert_seed(config, "expert") if first and config is not None else None
        gated = first and config is not None and config.gated_linear_unit
        with (
            weight_init.expert(seed),
            weight_init.gated_fc1() if gated else contextlib.nullcontext(),
        ):
            yield

    return _building_in(cls, "SeededExpert", as_expert)


def _gated_fc1_linear(cls: type) -> type:
    """``cls`` (an MLP's FC1 with ``--swiglu``) cutting its master weight as a gated FC1."""
    return _building_in(cls, "Gated", lambda config: weight_init.gated_fc1())


def _gated_mlp(spec: Any) -> Any:
    """A dense or shared-expert MLP spec whose FC1 is cut as a gated FC1."""
    return _with_submodules(
        spec, lambda sub: dataclasses.replace(sub, linear_fc1=_gated_fc1_linear(sub.linear_fc1))
    )


@contextlib.contextmanager
def _as_shared_expert(config: Any):
    """The shared expert draws from its own stream."""
    seed = _expert_seed(config, "shared-expert") if config is not None else None
    if seed is not None:
        weight_init.reseed(seed)
    yield


def _seeded_builder(build: Any) -> Any:
    """The shared expert's builder function (megatron-core 0.19) drawing from its own stream."""

    @functools.wraps(build)
    def seeded(*args, **kwargs):
        with _as_shared_expert(kwargs.get("config", args[0] if args else None)):
            return build(*args, **kwargs)

    return seeded


def _with_submodules(spec: Any, change: Any) -> Any:
    """``spec`` (a ModuleSpec, or megatron-core 0.19's ``functools.partial`` builder) with its
    submodules passed through ``change``."""
    if isinstance(spec, functools.partial):
        keywords = dict(spec.keywords)
        keywords["submodules"] = change(keywords["submodules"])
        return functools.partial(spec.func, *spec.args, **keywords)
    return dataclasses.replace(spec, submodules=change(spec.submodules))


def _seed_experts(mlp: Any, config_gated: bool) -> Any:
    """The MoE layer spec with seeded expert linears and a seeded shared expert (its FC1 cut as
    a gated one with ``config_gated``)."""

    def moe(submodules):
        experts = submodules.experts
        inner = (
            experts.keywords["submodules"]
            if isinstance(experts, functools.partial)
            else experts.submodules
        )
        if dataclasses.is_dataclass(inner) and hasattr(inner, "linear_fc1"):
            experts = _with_submodules(
                experts,
                lambda mlp_sub: dataclasses.replace(
                    mlp_sub,
                    linear_fc1=_seeded_expert_linear(mlp_sub.linear_fc1, first=True),
                    linear_fc2=_seeded_expert_linear(mlp_sub.linear_fc2, first=False),
                ),
            )
        shared = submodules.shared_experts
        if shared is not None and config_gated:
            shared = _gated_mlp(shared)
        if isinstance(shared, functools.partial):
            shared = functools.partial(
                _seeded_builder(shared.func), *shared.args, **shared.keywords
            )
        elif shared is not None:
            shared = dataclasses.replace(
                shared, module=_building_in(shared.module, "Seeded", _as_shared_expert)
            )
        return dataclasses.replace(submodules, experts=experts, shared_experts=shared)

    return _with_submodules(mlp, moe)


def padded_vocab_size(vocab_size: int, args: Namespace) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: a multiple of divisible-by x TP size."""
    from megatron_npu.training.checkpoint_store import padded_vocab_size as padded

    return padded(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def params_dtype(args: Namespace) -> torch.dtype:
    if args.fp16:
        return torch.float16
    if args.bf16:
        return torch.bfloat16
    return torch.float32


def _gradient_accumulation_fusion(args: Namespace) -> bool:
    """``--gradient-accumulation-fusion`` where a kernel serves it: the adaptor's off CUDA,
    apex's ``fused_weight_gradient_mlp_cuda`` on cuda; asked for without one, off with one line."""
    if not args.gradient_accumulation_fusion:
        return False
    if tensor_parallel.layers._grad_accum_fusion_available:
        return True
    _say_no_gradient_accumulation_fusion()
    return False


@functools.cache
def _say_no_gradient_accumulation_fusion() -> None:
    console.warn(
        "megatron-npu: --gradient-accumulation-fusion is off: apex's "
        "fused_weight_gradient_mlp_cuda is not installed (--no-gradient-accumulation-fusion "
        "says so)"
    )


def transformer_config(args: Namespace, dist_backend: str = "gloo") -> TransformerConfig:
    """The TransformerConfig Megatron-LM's ``core_transformer_config_from_args`` would build.

    Megatron's own fusion flags are honoured: ``bias_activation_fusion`` is
    ``--bias-swiglu-fusion`` with ``--swiglu``, else ``--bias-gelu-fusion``;
    ``masked_softmax_fusion``, ``gradient_accumulation_fusion`` and ``bias_dropout_fusion`` are
    ``--masked-softmax-fusion``, ``--gradient-accumulation-fusion`` and ``--bias-dropout-fusion``
    (all on by default, as in Megatron-LM, whose 16-bit numerics they set: the weight gradient
    accumulated in fp32 or rounded to 16 bits first); the registry patches route those fused
    functions to the op layer (the NPU kernels on npu / npu-emulated). Gradient accumulation
    fusion on cuda needs apex's extension and is off, with one line, without it. Persistent
    layer norm and the rope fusion stay off (train's RoPE is unfused).

    ``deallocate_pipeline_outputs`` (free a stage's output once sent) is off on gloo: gloo's
    ``isend`` reads the tensor from its own thread, and the interleaved schedule frees the output
    before waiting on the send, so the receiver can get the freed placeholder's bytes. NCCL/HCCL
    sends are stream-ordered and keep Megatron's default (on).
    """
    config_class, mla = TransformerConfig, {}
    if args.multi_latent_attention:
        config_class, mla = MLATransformerConfig, mla_config(args)
    config = config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        qk_layernorm=args.qk_layernorm,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type if args.context_parallel_size > 1 else None,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        use_cpu_initialization=args.use_cpu_initialization,
        perform_initialization=True,
        deallocate_pipeline_outputs=dist_backend != "gloo",
        # Megatron-LM: overlapped (unbatched, even/odd-ordered) p2p for the interleaved schedule,
        # batched p2p otherwise. With PP=2 and virtual stages both neighbours are the same rank,
        # and only the unbatched path keeps the two directions apart.
        overlap_p2p_comm=bool(args.virtual_pipeline_model_parallel_size),
        batch_p2p_comm=not args.virtual_pipeline_model_parallel_size,
        gradient_accumulation_fusion=_gradient_accumulation_fusion(args),
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations,
        **({"recompute_modules": args.recompute_modules} if args.recompute_modules else {}),
        # the layer spec's name, where the config has the field (0.14+), as Megatron-LM sets it
        **_if_field(config_class, "transformer_impl", args.transformer_impl),
        **(moe_config(args) if args.num_experts is not None else {}),
        **mla,
    )
    if args.layout_independent_init:
        # Read by SeededTransformerLayer; not a TransformerConfig field, so set after construction.
        config.init_seed = args.seed
        weight_init.wrap_init_methods(config)
    return config


def _if_field(config_class: type, name: str, value: Any) -> dict[str, Any]:
    """``{name: value}`` when ``config_class`` has the field ``name``, else nothing."""
    return {name: value} if name in {f.name for f in dataclasses.fields(config_class)} else {}


def mla_config(args: Namespace) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of ``--multi-latent-attention`` as Megatron-LM's
    ``core_transformer_config_from_args`` fills them: its options' values (the rotary scaling
    factor 1, not the dataclass's 40), the dataclass's own default for what it has no option
    for, ``rope_type`` only when given (the dataclass's default: yarn)."""
    fields = dict(
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
    )
    if args.rope_type is not None:
        fields["rope_type"] = args.rope_type
    return fields


def moe_config(args: Namespace) -> dict[str, Any]:
    """The TransformerConfig fields of ``--num-experts`` and its options (Megatron-LM's names)."""
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_dtype=args.moe_router_dtype,
        moe_layer_freq=args.moe_layer_freq,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_permute_fusion=args.moe_permute_fusion,
        **({"moe_router_fusion": True} if args.moe_router_fusion else {}),
    )


def layer_spec(args: Namespace, moe_layer: bool = True) -> ModuleSpec:
    """Megatron's local or Transformer Engine layer spec (``--transformer-impl``), its
    ``TransformerLayer`` seeded per global layer (and MoE experts per global expert); a dense
    layer's when ``moe_layer`` is False or the model has no experts."""
    experts = args.num_experts if moe_layer else None
    options = {
        "num_experts": experts,
        "moe_grouped_gemm": args.moe_grouped_gemm,
        "qk_layernorm": args.qk_layernorm,
    }
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            **options, multi_latent_attention=args.multi_latent_attention
        )
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, **options)
    if experts is not None:
        mlp = _seed_experts(spec.submodules.mlp, config_gated=args.swiglu)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    elif args.swiglu:
        mlp = _gated_mlp(spec.submodules.mlp)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    return dataclasses.replace(spec, module=SeededTransformerLayer)


def block_spec(args: Namespace, config: TransformerConfig, vp_stage: int | None) -> Any:
    """The layer spec of every layer (one spec), or, where ``--moe-layer-freq`` mixes dense and
    MoE layers, the block of this pipeline stage's layers, each from its place in the pattern
    (what Megatron-LM's ``get_gpt_decoder_block_spec`` builds)."""
    spec = layer_spec(args)
    if args.num_experts is None:
        return spec
    pattern = moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    if all(pattern):
        return spec
    dense = layer_spec(args, moe_layer=False)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[spec if pattern[offset + i] else dense for i in range(count)],
        layer_norm=transformer_block.LayerNormImpl,  # the final norm a single spec gets
    )


def build_chunks(args: Namespace, config: TransformerConfig, vocab_size: int) -> list[GPTModel]:
    """One ``GPTModel`` per virtual pipeline stage of this rank (one without interleaving)."""
    vpp = args.virtual_pipeline_model_parallel_size
    independent = args.layout_independent_init
    saved = torch.default_generator.get_state()
    chunks = []
    try:
        for index in range(vpp or 1):
            vp_stage = index if vpp else None
            if independent:
                weight_init.reseed(derived_seed(args.seed, "model"))
            model = GPTModel(
                config=config,
                transformer_layer_spec=block_spec(args, config, vp_stage),
                vocab_size=vocab_size,
                max_sequence_length=args.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                parallel_output=True,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type,
                rotary_percent=args.rotary_percent,
                rotary_base=args.rotary_base,
                vp_stage=vp_stage,
            )
            model.model_type = ModelType.encoder_or_decoder
            model.vp_stage = vp_stage
            chunks.append(model)
    finally:
        if independent:  # dropout streams do not depend on how much the build drew
            torch.default_generator.set_state(saved)
    for model in chunks:
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return chunks


def ddp_config(args: Namespace) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )


def build(args: Namespace, device: Device, vocab_size: int, local_rank: int = 0):
    """Build, place, cast and wrap the model chunks: ``(chunks, config)``.

    Wrapping order is Megatron-LM's ``get_model``: ``GPTModel`` -> ``Float16Module`` (fp16/bf16)
    -> ``DistributedDataParallel``.
    """
    config = transformer_config(args, device.dist_backend)
    chunks = build_chunks(args, config, vocab_size)
    target = device.torch_device(None if device.torch_type == "cpu" else local_rank)
    for chunk in chunks:
        chunk.to(target)
    wrapped: list[torch.nn.Module] = list(chunks)
    if args.fp16 or args.bf16:
        wrapped = [Float16Module(config, chunk) for chunk in wrapped]
    ddp = ddp_config(args)
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp, module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(wrapped)
    ]
    return wrapped, config


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while not isinstance(chunk, GPTModel):
        chunk = chunk.module
    return chunk
