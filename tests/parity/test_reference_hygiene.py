"""References are independent of the code under test and always run on the CPU.

* No case's reference (nor its same-dtype benchmark run) calls, builds or reads the object its
  patch installs, nor any function of the adaptor's compute layers (``megatron_npu.ops``,
  ``modules``, ``optim``) or of the module defining the patch's replacement: tripwires on every
  installed site plus a profiler hook. (Other patches' device plumbing, e.g. the RNG tracker a
  Megatron module forks, is Megatron's own environment and may run.)
* A planted reference that calls the implementation gives an ``error`` record (rule
  ``reference_hygiene``) at run time.
* With an off-CPU stand-in device active (``"cuda"`` routed to ``meta``), Megatron code reached
  by a reference (``get_default_causal_mask``, ``GlobalMemoryBuffer``) still allocates on the
  CPU, and the reference's outputs equal those computed with the CPU device.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
from megatron_npu.parity.case import Context, upcast
from megatron_npu.parity.harness import Job, evaluate, reference_environment
from megatron_npu.parity.matrix import case_examples, patches_with_cases

import megatron_npu
from megatron_npu import patcher
from megatron_npu.devices.base import Device
from megatron_npu.devices.cpu import CpuAccelerator
from megatron_npu.registry import get_patch

ADAPTOR = Path(megatron_npu.__file__).resolve().parent
COMPUTE = tuple(str(ADAPTOR / part) + "/" for part in ("ops", "modules", "optim"))


def _replacement_file(patch) -> str:
    obj = patch.replacement
    return inspect.getsourcefile(
        obj if inspect.isroutine(obj) or inspect.isclass(obj) else type(obj)
    )


def _adaptor_calls(fn, forbidden):
    """Run ``fn`` and return the functions under ``forbidden`` paths it called (file:name)."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(forbidden):
            seen.add(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, seen


@pytest.mark.parametrize(
    ("patch", "case"), patches_with_cases(), ids=lambda x: getattr(x, "id", "")
)
def test_reference_never_reaches_the_implementation(patch, case):
    megatron_npu.apply("npu-emulated")
    original = patcher.original(patch)
    params = case_examples(case.name, "quick")[0]
    inputs = case.make_inputs(params)
    for dtype in (torch.float32, torch.bfloat16):
        if not case.supports("npu-emulated", dtype):
            continue
        for ref_dtype in (upcast(dtype), dtype):  # the reference and the benchmark run
            ctx = Context(params, ref_dtype, dtype, torch.device("cpu"), original, case.parallel[0])
            with reference_environment(patch) as hits:
                out, calls = _adaptor_calls(
                    lambda ctx=ctx: case.reference(ctx, inputs),
                    (*COMPUTE, _replacement_file(patch)),
                )
            assert hits == [], f"{case.name}: reference touched the patched object: {hits}"
            assert not calls, f"{case.name}: reference called adaptor code: {sorted(calls)}"
            assert all(t.device.type == "cpu" for t in out.values())


def test_tripwires_catch_every_installed_site_and_are_removed():
    megatron_npu.apply("cpu")
    patch = get_patch("activation.bias-swiglu")
    owner, name = patcher.resolve(patch.target)
    installed = getattr(owner, name)
    with reference_environment(patch) as hits:
        fused = importlib.import_module("megatron.core.fusions.fused_bias_swiglu")
        fused.bias_swiglu_impl(torch.randn(2, 8), None)
    assert hits and all("activation.bias-swiglu" in h for h in hits)
    assert getattr(owner, name) is installed
    # and the profiler check sees a call into the op layer
    from megatron_npu.ops.swiglu import swiglu

    _, calls = _adaptor_calls(lambda: swiglu(torch.randn(2, 8)), COMPUTE)
    assert "swiglu.py:swiglu" in calls


def test_planted_reference_calling_the_implementation_is_an_error_record(monkeypatch):
    patch = get_patch("activation.bias-swiglu")
    module_name, _, attr = patch.parity.partition(":")
    module = importlib.import_module(module_name)
    case = getattr(module, attr)
    monkeypatch.setattr(module, attr, dataclasses.replace(case, reference=case.run))
    job = Job(patch.id, "cpu", "float32", case.parallel[0], case_examples(case.name, "quick")[:1])
    record = evaluate(job)
    assert (record.verdict.status, record.verdict.rule) == ("error", "reference_hygiene")
    assert "reached the implementation" in record.verdict.reason
    assert record.tensors == {}


class _MetaAccelerator(CpuAccelerator):
    name = "meta-stand-in"

    def current_device(self) -> torch.device:
        return torch.device("meta")


def _meta_device() -> Device:
    """An off-CPU stand-in: the adaptor routes Megatron's "cuda" to the meta device."""
    return Device(
        name="npu", torch_type="meta", dist_backend="gloo", accelerator=_MetaAccelerator()
    )


def test_references_stay_on_cpu_with_an_off_cpu_device_active():
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    patch = get_patch("attention.dot-product")
    case = dict((p.id, c) for p, c in patches_with_cases())[patch.id]
    params = next(p for p in case_examples(case.name, "quick") if p["mask"] == "causal")
    inputs = case.make_inputs(params)

    def reference():
        ctx = Context(
            params, torch.float32, torch.bfloat16, torch.device("cpu"), patcher.original(patch)
        )
        with reference_environment(patch) as hits:
            out = case.reference(ctx, inputs)
        assert hits == []
        return out

    megatron_npu.apply("cpu")
    on_cpu = reference()
    try:
        megatron_npu.apply(_meta_device())
        # the stand-in has teeth: without the reference environment Megatron lands on meta
        assert get_default_causal_mask(4).device.type == "meta"
        assert GlobalMemoryBuffer().get_tensor((2, 2), torch.float32, "x").device.type == "meta"
        with_meta = reference()
        assert megatron_npu.devices.active().torch_type == "meta"  # put back afterwards
    finally:
        megatron_npu.apply("cpu")
    assert set(with_meta) == set(on_cpu)
    for name, tensor in with_meta.items():
        assert tensor.device.type == "cpu", name
        torch.testing.assert_close(tensor, on_cpu[name], rtol=0, atol=0)
