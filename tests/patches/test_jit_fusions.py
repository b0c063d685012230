"""Megatron's ``@jit_fuser`` (``torch.compile``) functions run eagerly on non-CUDA devices."""

from __future__ import annotations

import pytest
import torch

import megatron_npu
from megatron_npu import patcher
from megatron_npu.patches import jit_fusions

_INSTALLED = patcher.megatron_core_version()
_HERE = [p for p in jit_fusions.PATCHES if p.applies_to_version(_INSTALLED) and p.kind == "wrap"]
_DECORATORS = [
    p for p in jit_fusions.PATCHES if p.applies_to_version(_INSTALLED) and p.kind == "replace"
]


@pytest.mark.parametrize("patch", _HERE, ids=lambda p: p.id)
def test_jit_fused_function_runs_eagerly(patch):
    """In transparent mode on cpu (where ``torch.cuda.is_available()`` is True and inductor would
    ask the stand-in device for GPU properties), the installed function is Megatron's own
    undecorated function: calling it compiles nothing."""
    owner, name = patcher.resolve(patch.target)
    compiled = getattr(owner, name)
    assert hasattr(compiled, "_torchdynamo_orig_callable"), f"{patch.target} is not compiled"
    megatron_npu.apply("cpu", transfer=True)
    try:
        installed = getattr(*patcher.resolve(patch.target))
        assert installed is compiled._torchdynamo_orig_callable
        assert not hasattr(installed, "_torchdynamo_orig_callable")
    finally:
        megatron_npu.restore()
    assert getattr(*patcher.resolve(patch.target)) is compiled


@pytest.mark.parametrize("patch", _DECORATORS, ids=lambda p: p.id)
def test_jit_fuser_decorator_is_eager_while_applied(patch):
    """Where Megatron decorates functions while it runs (GroupedMLP's GLU inside ``__init__``),
    the module's ``jit_fuser`` hands the function back undecorated while the adaptor is applied,
    and is ``torch.compile`` again after restore."""

    def glu(x):
        return x

    owner, name = patcher.resolve(patch.target)
    compiled = getattr(owner, name)
    assert compiled is torch.compile
    megatron_npu.apply("cpu", transfer=True)
    try:
        assert getattr(*patcher.resolve(patch.target))(glu) is glu
    finally:
        megatron_npu.restore()
    assert getattr(*patcher.resolve(patch.target)) is torch.compile


def test_eager_bias_dropout_add_compiles_nothing():
    """Behaviour, not only identity: Megatron's bias-dropout-add through the installed function
    leaves dynamo's frame counter untouched and gives the eager result."""
    from megatron.core.fusions import fused_bias_dropout
    from torch._dynamo.utils import counters

    x, bias, residual = (torch.randn(4, 2, 8) for _ in range(3))
    megatron_npu.apply("cpu", transfer=True)
    try:
        before = sum(counters["frames"].values())
        # (inference works in place on x: every call gets fresh copies)
        out = fused_bias_dropout.bias_dropout_add_fused_inference((x.clone(), bias), residual, 0.0)
        assert sum(counters["frames"].values()) == before
    finally:
        megatron_npu.restore()
    eager = fused_bias_dropout.bias_dropout_add_fused_inference._torchdynamo_orig_callable
    assert torch.equal(out, eager((x.clone(), bias), residual, 0.0))
    assert torch.allclose(out, residual + x + bias)


def test_every_jit_fuser_function_on_the_dense_path_is_listed():
    """A new ``@jit_fuser`` function in the fusions package must be added to the list (or it
    would reach torch.compile on the device): the module attributes that are compiled wrappers
    are all among the targets."""
    import importlib
    import pkgutil

    import megatron.core.fusions as fusions

    targets = {t for t, _ in jit_fusions.TARGETS}
    compiled = set()
    for info in pkgutil.iter_modules(fusions.__path__):
        if info.name in ("fused_pad_routing_map",):  # MoE routing, not on the dense path
            continue
        try:
            module = importlib.import_module(f"{fusions.__name__}.{info.name}")
        except ImportError:
            continue
        for key, value in vars(module).items():
            if hasattr(value, "_torchdynamo_orig_callable") and value.__module__ == module.__name__:
                compiled.add(f"{module.__name__}.{key}")
    missing = sorted(compiled - targets)
    assert not missing, f"compiled fusions without a jit-eager patch: {missing}"
