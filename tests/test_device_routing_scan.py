"""Device routing is derived from a scan of Megatron's sources for CUDA uses: every CUDA-using
module of the installed megatron-core is routed or named as deliberately unrouted with a reason,
so a Megatron module that starts calling ``torch.cuda`` cannot slip through unrouted."""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_npu.devices import cuda_scan
from megatron_npu.devices.cuda_scan import classify, cuda_using_modules
from megatron_npu.patches import device_namespace
from megatron_npu.patches.device_namespace import MODULES, NOT_ROUTED, ROUTED


def _ast_cuda_modules(package: str) -> set[str]:
    """An independent scan: ``torch.cuda`` attributes and "cuda"/"cuda:N" string constants in
    the syntax tree (so comments cannot count)."""
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    found = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_bytes())
        for node in ast.walk(tree):
            torch_cuda = (
                isinstance(node, ast.Attribute)
                and node.attr == "cuda"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            )
            device = (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (node.value == "cuda" or node.value.startswith("cuda:"))
            )
            if torch_cuda or device:
                parts = path.relative_to(root).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                found.add(".".join((package, *parts)))
                break
    return found


def test_every_cuda_using_megatron_module_is_routed_or_unrouted_for_a_stated_reason():
    scanned = cuda_using_modules("megatron.core")
    routed, skipped, unclassified = classify(scanned, ROUTED, NOT_ROUTED)
    assert unclassified == [], (
        f"Megatron modules use CUDA but are neither routed nor in NOT_ROUTED: {unclassified}; "
        "add their package to device_namespace.ROUTED or say why not in NOT_ROUTED"
    )
    assert tuple(routed) == MODULES
    assert all(reason.strip() for reason in skipped.values())
    # the scan misses nothing the syntax tree shows
    assert _ast_cuda_modules("megatron.core") <= set(scanned)


def test_the_gpt_training_modules_are_among_the_routed():
    for module in (
        "megatron.core.parallel_state",
        "megatron.core.tensor_parallel.random",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.transformer.transformer_layer",
    ):
        assert module in MODULES, module


def test_each_not_routed_entry_still_matches_something():
    """A stale exemption (Megatron moved the module) would silently exempt its successor."""
    scanned = cuda_using_modules("megatron.core")
    for prefix in NOT_ROUTED:
        assert any(m == prefix or m.startswith(prefix + ".") for m in scanned), prefix


@pytest.fixture
def fake_megatron(tmp_path, monkeypatch):
    def write(rel, text):
        path = tmp_path / "fakemeg4" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))

    write("__init__.py", "")
    write("core/__init__.py", "")
    write("core/train/__init__.py", "")
    write(
        "core/train/step.py", "import torch\n\ndef f():\n    return torch.cuda.current_device()\n"
    )
    write("core/train/plain.py", "import torch\n\ndef g():\n    return torch.zeros(1)\n")
    write("core/train/gpu_only.py", "import torch\nx = torch.empty(1, device='cuda:0')\n")
    write("core/newfeature.py", "import torch\n\ndef h():\n    torch.cuda.synchronize()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cuda_using_modules.cache_clear()
    yield "fakemeg4.core"
    cuda_using_modules.cache_clear()
    for name in [n for n in sys.modules if n.startswith("fakemeg4")]:
        del sys.modules[name]


def test_a_new_module_using_torch_cuda_outside_the_routed_scope_is_unclassified(fake_megatron):
    scanned = cuda_scan.cuda_using_modules(fake_megatron)
    assert set(scanned) == {
        "fakemeg4.core.train.step",
        "fakemeg4.core.train.gpu_only",
        "fakemeg4.core.newfeature",
    }
    routed, skipped, unclassified = classify(
        scanned, ("fakemeg4.core.train",), {"fakemeg4.core.train.gpu_only": "GPU only"}
    )
    assert routed == ["fakemeg4.core.train.step"]  # new module in a routed package: routed
    assert skipped == {"fakemeg4.core.train.gpu_only": "GPU only"}
    assert unclassified == ["fakemeg4.core.newfeature"]  # nobody decided: the real test fails


def test_the_registry_routes_exactly_the_derived_modules():
    targets = {p.target.removesuffix(".torch") for p in device_namespace.PATCHES}
    assert targets == set(MODULES)
