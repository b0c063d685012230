"""Megatron's ``@jit_fuser`` functions run eagerly on non-CUDA devices.

Megatron decorates its elementwise fusions (bias-dropout-add, bias-GELU/SwiGLU/GeGLU and their
backwards, the fused cross-entropy pieces, ``L2Norm._norm``, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Inductor has no
backend for ``npu`` (Ascend's own graph mode is torchair, not inductor), and on ``cpu`` /
``npu-emulated`` in transparent mode it asks the stand-in ``torch.cuda`` for GPU properties it
cannot have (Megatron-LM's ``_warmup_jit_function`` stopped there). Each entry below installs the
function that ``torch.compile`` wrapped (``_torchdynamo_orig_callable``): exactly Megatron's own
code, run eagerly, so the numbers are the ones the compiled kernel approximates. Where the adaptor
replaces the op behind a fusion (``bias_gelu_impl``, ``bias_swiglu_impl``, the softmax, the
cross entropy), that replacement is what runs; these entries cover the rest.
"""

from __future__ import annotations

import sys
from typing import Any

from megatron_npu.registry import Patch

_FUSIONS = "megatron.core.fusions"

#: (dotted target, megatron-core versions) of every module- or class-level ``@jit_fuser`` function
#: on the GPT path, dense and MoE (SSM layers are not supported by the adaptor).
TARGETS: tuple[tuple[str, str], ...] = (
    (f"{_FUSIONS}.fused_bias_dropout.bias_dropout_add_fused_train", ""),
    (f"{_FUSIONS}.fused_bias_dropout.bias_dropout_add_fused_inference", ""),
    (f"{_FUSIONS}.fused_bias_gelu.bias_gelu", ""),
    (f"{_FUSIONS}.fused_bias_gelu.bias_gelu_back", ""),
    (f"{_FUSIONS}.fused_bias_swiglu.swiglu", ""),
    (f"{_FUSIONS}.fused_bias_swiglu.bias_swiglu", ""),
    (f"{_FUSIONS}.fused_bias_swiglu.swiglu_back", ""),
    (f"{_FUSIONS}.fused_bias_swiglu.bias_swiglu_back", ""),
    (f"{_FUSIONS}.fused_bias_swiglu.weighted_swiglu", ""),
    (f"{_FUSIONS}.fused_bias_swiglu.weighted_swiglu_back", ""),
    (f"{_FUSIONS}.fused_bias_geglu.geglu", ""),
    (f"{_FUSIONS}.fused_bias_geglu.bias_geglu", ""),
    (f"{_FUSIONS}.fused_bias_geglu.geglu_back", ""),
    (f"{_FUSIONS}.fused_bias_geglu.bias_geglu_back", ""),
    (f"{_FUSIONS}.fused_bias_geglu.quick_gelu", ">=0.15"),
    (f"{_FUSIONS}.fused_bias_geglu.quick_geglu", ">=0.15"),
    (f"{_FUSIONS}.fused_bias_geglu.quick_geglu_back", ">=0.15"),
    (f"{_FUSIONS}.fused_bias_geglu.weighted_quick_geglu", ">=0.15"),
    (f"{_FUSIONS}.fused_bias_geglu.weighted_quick_geglu_back", ">=0.15"),
    (f"{_FUSIONS}.fused_bias_geglu.weighted_bias_quick_geglu", ">=0.15"),
    (f"{_FUSIONS}.fused_bias_geglu.weighted_bias_quick_geglu_back", ">=0.15"),
    (f"{_FUSIONS}.fused_cross_entropy.calculate_logits_max", ""),
    (f"{_FUSIONS}.fused_cross_entropy.calculate_predicted_logits", ""),
    (f"{_FUSIONS}.fused_cross_entropy.calculate_cross_entropy_loss", ""),
    (f"{_FUSIONS}.fused_cross_entropy.calculate_gradients", ""),
    (f"{_FUSIONS}.fused_weighted_squared_relu.weighted_squared_relu", ">=0.14"),
    (f"{_FUSIONS}.fused_weighted_squared_relu.weighted_squared_relu_back", ">=0.14"),
    (f"{_FUSIONS}.fused_weighted_squared_relu._squared_relu_back", ">=0.14"),
    ("megatron.core.activations.squared_relu", ">=0.14"),
    ("megatron.core.activations.quick_gelu", ">=0.14"),
    ("megatron.core.activations.fast_gelu", ">=0.14"),
    ("megatron.core.transformer.utils.gelu_impl", ""),
    ("megatron.core.transformer.utils.erf_gelu", ""),
    ("megatron.core.transformer.torch_norm.L2Norm._norm", ""),
    ("megatron.core.transformer.attention.Attention._apply_output_gate", ">=0.16"),
    ("megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias", ">=0.16"),
    (
        "megatron.core.transformer.moe.token_dispatcher.MoEFlexTokenDispatcher.dispatch_preprocess",
        ">=0.16",
    ),
)


def eager(compiled: Any) -> Any:
    """The function ``torch.compile`` wrapped (``compiled`` itself when it is not compiled)."""
    return getattr(compiled, "_torchdynamo_orig_callable", compiled)


def eager_decorator(function: Any) -> Any:
    """``jit_fuser`` for functions Megatron decorates while it runs: the function itself."""
    return function


def patch_id(target: str) -> str:
    return "jit-eager." + target.removeprefix("megatron.core.").removeprefix("fusions.")


EXEMPT_TEST = "tests/patches/test_jit_fusions.py::test_jit_fused_function_runs_eagerly"

PATCHES = [
    Patch(
        id=patch_id(target),
        target=target,
        replacement=eager,
        kind="wrap",
        versions=versions,
        # the compiled wrapper takes (*args, **kwargs); the eager function is Megatron's own
        check_signature=False,
        reason="torch.compile (jit_fuser) has no npu backend and fails on the stand-in device: "
        "Megatron's own function, eager",
        parity_exempt="Megatron's own elementwise code, unchanged, run without torch.compile",
        exempt_test=f"{EXEMPT_TEST}[{patch_id(target)}]",
        benchmark_exempt="removes a compiler, adds no code of its own",
    )
    for target, versions in TARGETS
] + [
    Patch(
        id="jit-eager.moe.experts.jit_fuser",
        target="megatron.core.transformer.moe.experts.jit_fuser",
        replacement=eager_decorator,
        versions="<0.17",
        check_signature=False,
        # the name is torch.compile itself: copies of it are every `from torch import compile`
        # in any loaded module, the user's own included, which must keep theirs
        rebind_copies=False,
        reason="GroupedMLP decorates its GLU and prob-weighted activation with jit_fuser inside "
        "__init__, out of reach of a function patch: the decorator itself runs them eagerly",
        parity_exempt="Megatron's own elementwise code, unchanged, run without torch.compile",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_moe_trains[local-grouped-gemm]",
        benchmark_exempt="removes a compiler, adds no code of its own",
    )
]


def load_eagerly(device: str | None) -> bool:
    """Make ``megatron.core.jit`` hand out the identity decorator from the moment it loads, in a
    process about to train on ``device`` (None: the device ``megatron_npu.apply`` picks); True
    when it will.

    Loaded as Megatron ships it, ``jit_fuser`` is ``torch.compile``, and every module that
    decorates a function with it calls ``torch.compile`` while it loads (dynamo's import and its
    inductor set-up): about 1.3 s of each rank's start-up here, measured on a one-rank ``train``
    run, spent on wrappers that the entries above then replace with the very functions they
    wrapped. Loaded through this hook, ``jit_fuser``
    is the identity, as Megatron's own ``disable_jit_fuser()`` (Megatron-LM's
    ``--disable-jit-fuser``) sets it, before any module takes it, so those modules hold Megatron's
    functions themselves: the code that runs is the same, and the entries above find nothing to
    unwrap.

    Only for a device these entries serve, with none of them disabled (``--disable-patch``,
    ``$MEGATRON_NPU_DISABLE``), and only before
    ``megatron.core`` is first imported (afterwards the entries above do the work). A process
    that calls it keeps the eager functions for its life: entry points call it (a rank, a
    script's ``import megatron_npu.auto``), ``megatron_npu.apply`` does not, so a process that
    applies and restores keeps Megatron's compiled functions.
    """
    from megatron_npu import devices, patcher

    # no name given: auto-detection (left to apply, which runs it once) picks npu or cpu
    chosen = devices.chosen_name(device)
    if "megatron.core" in sys.modules or chosen not in (None, *PATCHES[0].devices):
        return False
    off = {i for ids, _ in patcher.disable_requests() for i in ids}
    if any(patch.id in off for patch in PATCHES):
        return False
    if not any(isinstance(f, _EagerJitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerJitFinder())
    return True


class _EagerJitFinder:
    """Finds ``megatron.core.jit`` as the other finders do; its loader sets ``jit_fuser`` to the
    identity right after the module's own code (every release has that name; not all have
    ``disable_jit_fuser``)."""

    NAME = "megatron.core.jit"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _EagerJitLoader(spec.loader)
        return spec


class _EagerJitLoader:
    """The path finder's loader of ``megatron.core.jit``, then ``jit_fuser`` set to the identity."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.jit_fuser = eager_decorator
