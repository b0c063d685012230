"""The activation-recomputation options that cannot work, as one list of named problems.

Megatron checks the granularity, method and layer count by ``assert`` in ``validate_args`` and
by ``ValueError`` in ``TransformerConfig``, a traceback per rank. One combination it does not
check at all: selective recomputation of the MLP (``--recompute-modules mlp``) in a model with
linear biases (``--add-bias-linear``, Megatron's default). The MLP returns its output bias, the
``linear_fc2.bias`` parameter itself, out of Megatron's ``CheckpointFunction``; autograd then
gives that parameter the checkpoint's backward as its own, so the recomputation in backward
returns a tensor whose backward is the checkpoint again, without end: a ``RecursionError``, or
on a host device memory exhausted first, on any device. ``megatron-npu train`` and Megatron-LM's
scripts through the adaptor check these before anything is built and stop with one line.
"""

from __future__ import annotations

from typing import Any

#: Megatron's ``--recompute-modules`` choices (``TransformerConfig.recompute_modules``)
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def recompute_problems(
    *,
    granularity: str | None,
    method: str | None,
    num_layers: int | None,
    modules: list[str] | None,
    add_bias_linear: bool,
    distribute_saved_activations: bool,
    tp: int,
    sequence_parallel: bool,
) -> list[str]:
    """Each broken combination as ``"--option ...: why"`` (empty when the options agree).
    ``modules`` None means Megatron's default for selective recomputation: ``core_attn``."""
    problems = []
    if granularity == "selective":
        if method is not None:
            problems.append(
                f"--recompute-method {method} with --recompute-granularity selective: a method "
                "chooses the layers of full recomputation; selective recomputes the chosen "
                "modules of every layer"
            )
        if num_layers is not None:
            problems.append(
                f"--recompute-num-layers {num_layers} with --recompute-granularity selective: "
                "the layer count belongs to full recomputation"
            )
        if "mlp" in (modules or ()) and add_bias_linear:
            problems.append(
                "--recompute-modules mlp with linear biases (Megatron's default "
                "--add-bias-linear): Megatron's checkpoint returns the MLP's bias parameter and "
                "its backward recurses without end, on any device; add --disable-bias-linear or "
                "leave mlp out"
            )
    elif granularity == "full":
        if method is None:
            problems.append("--recompute-granularity full: needs --recompute-method uniform|block")
        if num_layers is None:
            problems.append("--recompute-granularity full: needs --recompute-num-layers N")
    if distribute_saved_activations and (granularity != "full" or method is None or tp < 2):
        problems.append(
            "--distribute-saved-activations: splits the saved inputs of full recomputation over "
            "the tensor-parallel ranks, so it needs --recompute-granularity full, a "
            "--recompute-method and --tensor-model-parallel-size of 2 or more"
        )
    if distribute_saved_activations and sequence_parallel:
        problems.append(
            "--distribute-saved-activations with --sequence-parallel: the saved inputs are split "
            "over the tensor-parallel ranks already (Megatron's rule)"
        )
    return problems


def recompute_problems_of(args: Any) -> list[str]:
    """:func:`recompute_problems` of a namespace with Megatron-LM's option names (Megatron-LM's
    own, or ``megatron-npu train``'s: ``--recompute-activations`` is selective recomputation,
    and biases are on unless ``add_bias_linear`` is false or ``disable_bias_linear`` true)."""
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):
        granularity = "selective"
    biases = getattr(args, "add_bias_linear", not getattr(args, "disable_bias_linear", False))
    return recompute_problems(
        granularity=granularity,
        method=getattr(args, "recompute_method", None),
        num_layers=getattr(args, "recompute_num_layers", None),
        modules=getattr(args, "recompute_modules", None),
        add_bias_linear=bool(biases),
        distribute_saved_activations=bool(getattr(args, "distribute_saved_activations", False)),
        tp=getattr(args, "tensor_model_parallel_size", 1) or 1,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
    )
