"""Megatron's Transformer Engine spec builds and trains without TE, with TE's checkpoint keys.

The GPT model built from ``get_gpt_layer_with_transformer_engine_spec`` (Megatron-LM's default
``--transformer-impl transformer_engine``) has the parameter names a GPU run with TE has
(``linear_qkv.layer_norm_weight`` ... ``_extra_state``; the list below follows megatron-core's
own wrappers: ``TELayerNormColumnParallelLinear`` for QKV and FC1, ``TERowParallelLinear`` for
the projections, ``TEDotProductAttention`` for the core attention, no separate input / pre-MLP
norms) and computes what the local-spec model computes with the same weights.
"""

from __future__ import annotations

import importlib.util
import io
import pickle

import pytest
import torch

import megatron_npu
from megatron_npu.modules import te_layers

SEQ, VOCAB, BATCH, HIDDEN = 16, 64, 2, 32


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def _gpt(spec, config, seed: int = 1234):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ
    )


def _te_spec(**kwargs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(**kwargs)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).expand(BATCH, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens, position_ids, causal


#: the keys of one layer a GPU run with TE writes (torch-format state dict), per normalization
def _te_layer_keys(layer: int, layer_norm: bool, bias: bool = True) -> set[str]:
    p = f"decoder.layers.{layer}."
    norm = {"layer_norm_weight"} | ({"layer_norm_bias"} if layer_norm else set())
    linear = {"weight", "_extra_state"} | ({"bias"} if bias else set())
    keys = {f"{p}self_attention.core_attention._extra_state"}
    for name, extra in (
        ("self_attention.linear_qkv", norm),
        ("self_attention.linear_proj", ()),
        ("mlp.linear_fc1", norm),
        ("mlp.linear_fc2", ()),
    ):
        keys |= {f"{p}{name}.{k}" for k in linear | set(extra)}
    return keys


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_te_spec_model_has_te_parameter_names(gloo_world_of_one, cpu_adaptor, normalization):
    model = _gpt(_te_spec(), _config(normalization=normalization))
    keys = set(model.state_dict())
    layer_keys = {k for k in keys if k.startswith("decoder.layers.")}
    want = _te_layer_keys(0, normalization == "LayerNorm") | _te_layer_keys(
        1, normalization == "LayerNorm"
    )
    assert layer_keys == want, (sorted(layer_keys - want), sorted(want - layer_keys))
    # the block's final norm is TE's too (a process with TE builds TENorm there)
    final = {k for k in keys if k.startswith("decoder.final_layernorm.")}
    norm_keys = {"weight", "_extra_state"} | ({"bias"} if normalization == "LayerNorm" else set())
    assert final == {f"decoder.final_layernorm.{k}" for k in norm_keys}
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    names = [n for n, _ in qkv.named_parameters()]
    assert names == (
        ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
        if normalization == "LayerNorm"
        else ["layer_norm_weight", "weight", "bias"]
    )
    assert qkv.weight.partition_dim == 0 and qkv.weight.tensor_model_parallel
    assert not getattr(qkv.layer_norm_weight, "tensor_model_parallel", False)
    proj = model.decoder.layers[0].self_attention.linear_proj
    assert proj.weight.partition_dim == 1
    extra = model.state_dict()["decoder.layers.0.self_attention.linear_qkv._extra_state"]
    assert extra.dtype == torch.uint8 and extra.numel() == 0  # TE 2.4+ with fp8 off


def test_te_spec_sharded_keys_leave_core_attention_extra_state_out(gloo_world_of_one, cpu_adaptor):
    """From megatron-core 0.15 TE's attention wrapper keeps ``_extra_state`` out of distributed
    checkpoints; the linears' ``_extra_state`` are sharded objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded = _gpt(_te_spec(), _config()).sharded_state_dict()
    attention = [k for k in sharded if "core_attention" in k]
    from megatron_npu.patcher import megatron_core_below

    below_015 = megatron_core_below("0.15")
    assert bool(attention) == below_015, attention
    extra = sharded["decoder.layers.0.self_attention.linear_qkv._extra_state"]
    assert isinstance(extra, ShardedObject)
    assert extra.key == "decoder.layers.self_attention.linear_qkv._extra_state"  # layers stacked


def test_a_state_without_core_attention_extra_state_loads_strictly(gloo_world_of_one, cpu_adaptor):
    """What a distributed checkpoint brings back lacks the core attention's ``_extra_state``
    (above): TE's DotProductAttention lets a strict load miss it, and so does the adaptor's, while
    any other missing key still fails the load."""
    model = _gpt(_te_spec(), _config())
    state = {k: v for k, v in model.state_dict().items() if "core_attention._extra_state" not in k}
    assert len(state) < len(model.state_dict())
    model.load_state_dict(state, strict=True)
    del state["decoder.layers.0.self_attention.linear_qkv.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*linear_qkv\.weight"):
        model.load_state_dict(state, strict=True)


@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_te_spec_computes_what_the_local_spec_computes(
    gloo_world_of_one, cpu_adaptor, normalization, zero_centered
):
    """Same weights (the local spec's input / pre-MLP norms are the TE linears' fused norms):
    same loss and same gradients, forward and backward."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(
        normalization=normalization, layernorm_zero_centered_gamma=zero_centered, qk_layernorm=True
    )
    te = _gpt(_te_spec(qk_layernorm=True), config)
    local = _gpt(get_gpt_layer_local_spec(qk_layernorm=True, normalization=normalization), config)
    renamed = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
        "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    }
    te_params = dict(te.named_parameters())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in local.named_parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))  # norms away from 1 / 0
            target = name
            for old, new in renamed.items():
                target = target.replace(old, new)
            te_params[target].copy_(param)
    tokens, position_ids, mask = _batch()
    losses = {}
    for name, model in (("te", te), ("local", local)):
        loss = model(tokens, position_ids, mask, labels=tokens).mean()
        loss.backward()
        losses[name] = loss
    torch.testing.assert_close(losses["te"], losses["local"], rtol=1e-6, atol=1e-6)
    for name, param in local.named_parameters():
        target = name
        for old, new in renamed.items():
            target = target.replace(old, new)
        torch.testing.assert_close(
            te_params[target].grad,
            param.grad,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def test_te_block_spec_builds_with_te_norm(gloo_world_of_one, cpu_adaptor):
    """``get_gpt_decoder_block_spec(..., use_transformer_engine=True)`` (MoE and heterogeneous
    models) takes the block's norm from the GPT spec module's ``TENorm``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(_config(), use_transformer_engine=True)
    assert spec.layer_norm is te_layers.TENorm
    qkv = spec.layer_specs[0].submodules.self_attention.submodules.linear_qkv
    assert qkv is te_layers.stand_in("TELayerNormColumnParallelLinear")


def test_te_spec_moe_experts_are_te_linears(cpu_adaptor):
    """The TE spec's MoE experts without a grouped GEMM are one TE column/row linear pair per
    expert (TE's checkpoint keys, ``_extra_state`` included), as megatron-core builds them with
    TE >= 1.7; with ``--moe-grouped-gemm`` TE's grouped linears."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    def experts(grouped: bool):
        mlp = get_gpt_layer_with_transformer_engine_spec(
            num_experts=4, moe_grouped_gemm=grouped
        ).submodules.mlp
        spec = mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules
        found = spec.experts
        return found.keywords["submodules"] if hasattr(found, "keywords") else found.submodules

    sequential = experts(False)
    assert sequential.linear_fc1 is te_layers.stand_in("TEColumnParallelLinear")
    assert sequential.linear_fc2 is te_layers.stand_in("TERowParallelLinear")
    grouped = experts(True)
    assert grouped.linear_fc1 is te_layers.TEColumnParallelGroupedLinear
    assert grouped.linear_fc2 is te_layers.TERowParallelGroupedLinear


def test_placeholders_come_back_and_no_transformer_engine_module_appears():
    import megatron.core.extensions.transformer_engine as te
    import megatron.core.extensions.transformer_engine_spec_provider as provider

    placeholder = provider.TELayerNormColumnParallelLinear
    megatron_npu.apply("cpu")
    try:
        assert provider.TELayerNormColumnParallelLinear is te_layers.stand_in(
            "TELayerNormColumnParallelLinear"
        )
        assert te.TENorm is te_layers.TENorm and provider.TENorm is te_layers.TENorm
    finally:
        megatron_npu.restore()
    assert provider.TELayerNormColumnParallelLinear is placeholder
    assert importlib.util.find_spec("transformer_engine") is None


@pytest.mark.parametrize(
    "state",
    [
        None,
        torch.empty(0, dtype=torch.uint8),
        torch.frombuffer(bytearray(pickle.dumps(None, protocol=4)), dtype=torch.uint8),
        torch.frombuffer(bytearray(pickle.dumps({}, protocol=4)), dtype=torch.uint8),
    ],
    ids=["none", "empty", "te2.0-pickled-none", "te-norm-pickled-empty-dict"],
)
def test_extra_state_without_fp8_loads(state):
    te_layers.TEExtraState().set_extra_state(state)


def test_extra_state_of_te1_loads_and_fp8_state_is_refused_by_name():
    buffer = io.BytesIO()
    torch.save(None, buffer)
    te_layers.TEExtraState().set_extra_state(buffer)
    fp8 = torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": [1.0]})), dtype=torch.uint8)
    with pytest.raises(te_layers.FP8StateError, match="fp8 state"):
        te_layers.TEExtraState().set_extra_state(fp8)
