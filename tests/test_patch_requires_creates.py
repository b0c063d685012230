"""Registry fields for targets outside the megatron-core wheel (``requires``) and for module
globals that only exist when an optional CUDA extension imports (``creates``)."""

from __future__ import annotations

import sys
import types

import pytest

import megatron_npu
from megatron_npu import patcher
from megatron_npu.registry import Patch


@pytest.fixture
def module():
    """``fakelm.layers``: a module whose optional extension did not import."""
    pkg = types.ModuleType("fakelm")
    pkg.__path__ = []
    layers = types.ModuleType("fakelm.layers")
    layers.available = False
    sys.modules.update({"fakelm": pkg, "fakelm.layers": layers})
    yield layers
    for name in ("fakelm", "fakelm.layers"):
        sys.modules.pop(name, None)


def _apply(patches):
    return megatron_npu.apply("cpu", patches=patches, megatron_version="0.16.1")


def test_a_target_in_an_absent_training_layer_is_not_installed_not_an_error():
    patch = Patch(
        id="t.absent",
        target="nosuchlm.training.initialize.fn",
        replacement=lambda: None,
        reason="test",
        requires="nosuchlm.training.initialize",
        parity_exempt="t",
        exempt_test="x.py::t",
    )
    (result,) = _apply([patch])
    assert result.status == patcher.NOT_INSTALLED
    assert "nosuchlm.training.initialize is not importable" in result.reason


def test_a_partial_stand_in_package_does_not_count_as_installed(module):
    """``fakelm`` exists but has no ``fakelm.training``: the patch waits, nothing is raised."""
    patch = Patch(
        id="t.partial",
        target="fakelm.training.fn",
        replacement=lambda: None,
        reason="test",
        requires="fakelm.training",
        parity_exempt="t",
        exempt_test="x.py::t",
    )
    (result,) = _apply([patch])
    assert result.status == patcher.NOT_INSTALLED


def test_requires_must_hold_the_target():
    with pytest.raises(ValueError, match="is not in"):
        Patch(id="t.bad", target="a.b.c", replacement=1, reason="r", requires="x.y")


def test_a_created_global_is_installed_and_removed_again(module):
    kernel = types.SimpleNamespace(run=lambda: "ran")
    patches = [
        Patch(
            id="t.kernel",
            target="fakelm.layers.extension",
            replacement=kernel,
            creates=True,
            reason="test",
            parity_exempt="t",
            exempt_test="x.py::t",
        ),
        Patch(
            id="t.flag",
            target="fakelm.layers.available",
            replacement=True,
            reason="test",
            parity_exempt="t",
            exempt_test="x.py::t",
        ),
    ]
    results = _apply(patches)
    assert [r.status for r in results] == [patcher.APPLIED, patcher.APPLIED]
    assert module.extension is kernel and module.available is True
    megatron_npu.restore()
    assert not hasattr(module, "extension") and module.available is False


def test_an_existing_global_is_replaced_and_put_back(module):
    real = object()
    module.extension = real
    patch = Patch(
        id="t.kernel",
        target="fakelm.layers.extension",
        replacement=1,
        creates=True,
        reason="test",
        parity_exempt="t",
        exempt_test="x.py::t",
    )
    _apply([patch])
    assert module.extension == 1
    megatron_npu.restore()
    assert module.extension is real


def test_without_creates_a_missing_global_is_still_a_target_error(module):
    patch = Patch(
        id="t.kernel",
        target="fakelm.layers.extension",
        replacement=1,
        reason="test",
        parity_exempt="t",
        exempt_test="x.py::t",
    )
    with pytest.raises(patcher.PatchTargetError, match="t.kernel"):
        _apply([patch])
    assert not hasattr(module, "extension")
