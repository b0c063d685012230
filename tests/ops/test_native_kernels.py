"""Kernels served natively (``$MEGATRON_NPU_NATIVE_KERNELS``): the op that would call a listed
torch_npu kernel takes its native path on the same device, every other op keeps its kernel, and
a name no adaptor patch calls is one named error."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_npu.ops import kernels, norm, swiglu
from megatron_npu.registry import all_patches
from megatron_npu.testing import torch_npu_emulation as emulation
from tests.ops._paths import emulated_kernels, native_kernels_around_each_test  # noqa: F401


def _calls(monkeypatch, name: str) -> list[int]:
    """Count the emulation's calls of kernel ``name``."""
    calls: list[int] = []
    original = getattr(emulation, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(emulation, name, counted)
    return calls


def test_a_listed_kernel_is_served_natively_and_the_others_keep_theirs(monkeypatch):
    rms, glu = _calls(monkeypatch, "npu_rms_norm"), _calls(monkeypatch, "npu_swiglu")
    x, w = torch.randn(4, 8), torch.rand(8) + 0.5
    monkeypatch.setenv(kernels.NATIVE_ENV, "npu_rms_norm")
    with emulated_kernels():
        assert kernels.served_natively() == {"npu_rms_norm"}
        assert kernels.npu_kernels("npu_rms_norm") is None
        assert kernels.npu_kernels("npu_swiglu") is emulation
        y, rstd = norm.rms_norm(x, w, 1e-6)
        swiglu.swiglu(torch.randn(4, 8))
    assert (len(rms), len(glu)) == (0, 1)
    expected = norm.native_rms_norm(x, w, 1e-6)
    assert torch.equal(y, expected[0]) and torch.equal(rstd, expected[1])
    # unset: the kernel again
    monkeypatch.delenv(kernels.NATIVE_ENV)
    with emulated_kernels():
        norm.rms_norm(x, w, 1e-6)
        assert kernels.served_natively() == frozenset()
    assert len(rms) == 1


def test_an_op_of_several_kernels_is_native_when_any_of_them_is(monkeypatch):
    monkeypatch.setenv(kernels.NATIVE_ENV, "npu_fusion_attention_grad")
    with emulated_kernels():
        assert kernels.npu_kernels("npu_fusion_attention", "npu_fusion_attention_grad") is None
        assert kernels.npu_kernels("npu_fusion_attention") is emulation


def test_no_kernel_module_serves_everything_natively(monkeypatch):
    monkeypatch.setenv(kernels.NATIVE_ENV, "npu_rms_norm")
    kernels.use_npu_kernels(None)
    assert kernels.npu_kernels("npu_swiglu") is None and kernels.served_natively() == frozenset()


def test_an_unknown_kernel_name_is_one_named_error(monkeypatch):
    monkeypatch.setenv(kernels.NATIVE_ENV, "npu_rms_norm,npu_rms_nrom")
    with pytest.raises(
        ValueError, match=r"MEGATRON_NPU_NATIVE_KERNELS: npu_rms_nrom is not a kernel"
    ):
        kernels.use_npu_kernels(emulation)


def test_every_declared_kernel_has_an_op_that_honours_the_switch(monkeypatch):
    """Each kernel a registry patch declares, listed alone, turns some op call site native: the
    call sites name their kernels (a site that names none would ignore the switch)."""
    import inspect
    import re
    from pathlib import Path

    import megatron_npu

    root = Path(inspect.getfile(megatron_npu)).parent
    named: set[str] = set()
    for path in root.rglob("*.py"):
        for args in re.findall(r"npu_kernels\(([^)]*)\)", path.read_text(encoding="utf-8")):
            named.update(re.findall(r'"(npu_\w+)"', args))
    declared = {k for p in all_patches() for k in p.npu_kernels}
    assert declared <= named, sorted(declared - named)
    with mock.patch.dict("os.environ", {kernels.NATIVE_ENV: ",".join(sorted(declared))}):
        with emulated_kernels():
            assert kernels.served_natively() == declared
