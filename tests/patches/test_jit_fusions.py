"""Megatron's ``@jit_fuser`` (``torch.compile``) functions run eagerly on non-CUDA devices."""

from __future__ import annotations

import sys

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


_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
_MODEL += ["--seq-length", "32", "--micro-batch-size", "2"]
#: what each kind of process the adaptor runs in does first, on the device ``{device}``
_ENTRY_POINTS = {
    "script": "import megatron_npu.auto",
    "train-rank": "from megatron_npu import train\n"
    f"train.main(['--device', '{{device}}', '--mock-data', '--vocab-size', '255', *{_MODEL!r}, "
    "'--global-batch-size', '2', '--lr', '1e-3', '--train-iters', '1', '--progress', 'none'])",
    "evaluate-rank": "from megatron_npu.evaluate import command\n"
    "command._evaluate = lambda *args: None\n"
    f"command.worker_main(['--device', '{{device}}', '--task', 'lambada', *{_MODEL!r}])",
}
#: read once the adaptor is restored (while applied, the jit-eager entries make both look eager)
_REPORT = """
from megatron_npu.parity._selftest import megatron_fusions_compiled
print(*megatron_fusions_compiled())
"""


def _compiled_after(entry: str, device: str, **env: str) -> tuple[bool, bool]:
    """(Megatron's bias_gelu is a torch.compile wrapper, jit_fuser is torch.compile) in a fresh
    process once ``entry`` ran there on ``device``."""
    import os
    import subprocess
    import sys

    code = _ENTRY_POINTS[entry].format(device=device) + "\n" + _REPORT
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "MEGATRON_NPU_DEVICE": device, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, fuser_is_compile = done.stdout.split()[-2:]
    return compiled == "True", fuser_is_compile == "True"


@pytest.mark.parametrize(
    ("entry", "device"),
    [("script", "npu-emulated"), ("train-rank", "cpu"), ("evaluate-rank", "npu-emulated")],
)
def test_a_process_on_a_non_cuda_device_loads_megatrons_fusions_uncompiled(entry, device):
    """A script's ``import megatron_npu.auto``, a train rank and an evaluate rank load
    ``megatron.core.jit`` with the identity decorator: Megatron's fused functions are its own
    functions from the start, and stay so once the adaptor is restored, so no process pays for
    torch.compile wrapping functions that the jit-eager entries unwrap."""
    assert _compiled_after(entry, device) == (False, False)


def test_a_parity_rank_loads_megatrons_fusions_uncompiled():
    """A rank-pool worker for a non-CUDA device compiles nothing while it starts and applies the
    adaptor: Megatron's fusions load uncompiled there too."""
    from megatron_npu.parity.case import Parallel
    from megatron_npu.parity.harness import Job
    from megatron_npu.parity.ranks import RankPool

    pool = RankPool(2, timeout_s=120, runner="megatron_npu.parity._selftest:jit_fusions_compiled")
    try:
        assert pool.submit(Job("any", "cpu", "float32", Parallel(tp=2), ())) == {"compiled": False}
    finally:
        pool.close()


def test_megatron_loads_as_shipped_on_cuda_or_with_a_jit_eager_entry_disabled():
    """On ``cuda`` the hook stays out (Megatron's torch.compile fusions are its GPU path), and
    with a jit-eager entry switched off the user asked for that function compiled, so Megatron
    loads as shipped and the entries decide."""
    off = jit_fusions.patch_id("megatron.core.fusions.fused_bias_gelu.bias_gelu")
    assert _compiled_after("script", "cpu", MEGATRON_NPU_DISABLE=off) == (True, True)
    assert jit_fusions.load_eagerly("cuda") is False


def test_a_users_own_torch_compile_is_left_alone(monkeypatch):
    """The eager decorator goes to Megatron's experts module alone: a user's module that holds
    ``torch.compile`` under a name of its own (``from torch import compile``) keeps it while the
    adaptor is applied."""
    import types

    users = types.ModuleType("users_model")
    users.compile = torch.compile
    monkeypatch.setitem(sys.modules, users.__name__, users)
    megatron_npu.apply("cpu", transfer=True)
    try:
        assert users.compile is torch.compile
    finally:
        megatron_npu.restore()
