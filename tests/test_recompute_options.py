"""The premise of the one activation-recomputation refusal Megatron itself does not make:
``--recompute-modules mlp`` with linear biases recurses without end in the backward pass, in
Megatron's own code (its ``MLP`` under its ``CheckpointFunction``, as ``TransformerLayer`` calls
it), and runs once the biases are gone. The refusal is :mod:`megatron_npu.recompute_options`'s;
``megatron-npu train`` (``tests/training/test_arguments.py``) and Megatron-LM's scripts
(``tests/megatron_lm/test_pretrain_gpt.py``) stop on it with one line."""

from __future__ import annotations

import torch

from megatron_npu.recompute_options import recompute_problems


def _checkpointed_mlp(add_bias_linear: bool):
    """Megatron's local-spec MLP under its ``CheckpointFunction``, as ``TransformerLayer`` calls
    it for ``--recompute-modules mlp``: the module, its input and what the checkpoint returns."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        add_bias_linear=add_bias_linear,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
    )
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mlp = MLP(config, submodules, ffn_hidden_size=config.ffn_hidden_size)
    x = torch.randn(4, 1, 8, requires_grad=True)
    return mlp, x, tensor_parallel.checkpoint(mlp, False, x)


def test_megatrons_recomputed_mlp_with_biases_recurses(gloo_world_of_one, cpu_adaptor):
    """With biases the checkpoint hands back ``linear_fc2.bias`` itself, now carrying the
    checkpoint's backward: the recomputation in that backward returns the same parameter, whose
    backward is the checkpoint again (run, it recurses until memory or the stack gives out, so
    the test stops at the mechanism). Without biases the backward runs."""
    mlp, _, (output, bias) = _checkpointed_mlp(add_bias_linear=True)
    assert bias is mlp.linear_fc2.bias
    assert type(bias.grad_fn).__name__ == "CheckpointFunctionBackward"
    _, x, (output, bias) = _checkpointed_mlp(add_bias_linear=False)
    assert bias is None
    output.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_only_the_mlp_with_biases_is_refused():
    def problems(**options):
        given = dict(
            granularity="selective",
            method=None,
            num_layers=None,
            modules=["core_attn", "mlp"],
            add_bias_linear=True,
            distribute_saved_activations=False,
            tp=1,
            sequence_parallel=False,
        )
        return recompute_problems(**{**given, **options})

    assert [p.split(":")[0] for p in problems()] == [
        "--recompute-modules mlp with linear biases (Megatron's default --add-bias-linear)"
    ]
    assert problems(add_bias_linear=False) == []
    assert problems(modules=None) == []  # Megatron's default: core_attn
    assert problems(granularity="full", method="uniform", num_layers=1) == []
