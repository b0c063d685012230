"""``optimizer.*-cuda-fallback``: on a GPU with neither apex nor Transformer Engine, Megatron binds
its local multi-tensor fallbacks, which loop over the parameters in Python. Its gradient norm
then reads the device once per parameter (``torch.tensor`` of a list of device scalars) and its
clipping launches a multiply and a copy per parameter. With the entries, the foreach kernels
serve: one device read per norm, launches that do not grow with the parameter count, one line.

The entries are ``cuda`` ones; the tests install them through the patcher with their device
widened to this host's (``MEGATRON_NPU_DISABLE`` is honoured), beside the device routing that
lets Megatron's ``device="cuda"`` calls run here. Megatron binds the same fallbacks here, where
apex and TE are missing too."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_npu
from megatron_npu.devices.facts import CPU, CUDA, NON_CUDA
from megatron_npu.patcher import (
    APPLIED,
    KEPT_ORIGINAL,
    NOT_FOR_DEVICE,
    megatron_core_version,
    plan_status,
)
from megatron_npu.patches import optimizer as optimizer_patches
from megatron_npu.registry import all_patches, get_patch

_NORM = "optimizer.l2-norm-cuda-fallback"
_SCALE = "optimizer.multi-tensor-scale-cuda-fallback"
_ROUTING = (
    "torch-namespace:utils",
    "torch-namespace:optimizer.clip_grads",
    "tensor.type",
    "scope.clip-grads",
)
_LINE = (
    "megatron-npu: neither apex's nor Transformer Engine's multi-tensor kernels are installed; "
    "torch's foreach kernels serve Megatron's gradient norm and clipping in place of its "
    "per-parameter fallback"
)


def _apply_here() -> dict[str, str]:
    """Apply the entries here; their statuses by id."""
    entries = {p.id: p for p in all_patches()}
    widened = [dataclasses.replace(entries[i], devices=frozenset({CPU})) for i in (_NORM, _SCALE)]
    results = megatron_npu.apply(CPU, patches=[*widened, *(entries[i] for i in _ROUTING)])
    return {r.id: r.status for r in results}


@pytest.fixture
def cuda_entries_here(gloo_world_of_one):
    optimizer_patches._say_foreach_serves.cache_clear()
    statuses = _apply_here()
    assert statuses[_NORM] == statuses[_SCALE] == APPLIED
    yield
    megatron_npu.restore()


def _grads(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randn(3 + i % 5, 2 + i % 3, generator=gen) for i in range(count)]


def _device_reads(fn) -> int:
    """How many times ``fn`` reads a tensor's value back to the host (``_local_scalar_dense``,
    also where ``torch.tensor`` of a list of tensors reads them inside C++)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events())["aten::_local_scalar_dense"]


class _Launches(TorchDispatchMode):
    """Counts the ops called from Python that compute (each a kernel launch on a GPU; a foreach
    op is one); views such as Megatron's per-gradient ``detach`` launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def test_the_norm_reads_the_device_once(cuda_entries_here):
    """Megatron's ``get_grad_norm_fp32`` over 60 gradients: the L2 norm of all their elements
    (float64 reference) with one read of the device, Megatron's own final ``.item()``. Megatron's
    fallback reads it 61 times."""
    from megatron.core.optimizer import clip_grads

    grads = _grads(60)
    norms = []
    reads = _device_reads(lambda: norms.append(clip_grads.get_grad_norm_fp32(grads)))
    reference = torch.cat([g.double().flatten() for g in grads]).norm().item()
    assert norms[0] == pytest.approx(reference, rel=1e-6)
    assert reads == 1


def test_one_line_says_what_serves(gloo_world_of_one, capsys):
    """Applied twice in a process: the line is said once."""
    optimizer_patches._say_foreach_serves.cache_clear()
    for _ in range(2):
        _apply_here()
        megatron_npu.restore()
    assert capsys.readouterr().err.strip().splitlines() == [_LINE]


def test_clipping_launches_do_not_grow_with_the_parameters(cuda_entries_here):
    """Megatron's ``clip_grad_by_total_norm_fp32`` scales every gradient by
    ``max_norm / (total + 1e-6)`` with the same launches for 20 parameters as for 80 (the
    fallback launches two per parameter)."""
    from megatron.core.optimizer import clip_grads

    launches = []
    for count in (20, 80):
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(count)]
        for param, grad in zip(params, _grads(count), strict=True):
            param.grad = grad.clone()
        total = torch.cat([g.flatten() for g in _grads(count)]).norm().item()
        counter = _Launches()
        with counter:
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
        launches.append(counter.count)
        coeff = 1.0 / (total + 1.0e-6)
        for param, grad in zip(params, _grads(count), strict=True):
            torch.testing.assert_close(param.grad, grad * coeff, rtol=1e-6, atol=0)
    assert launches[0] == launches[1]


def test_the_mixed_precision_copy_takes_the_same_kernel(cuda_entries_here):
    """Megatron's optimizer module binds ``multi_tensor_scale_impl`` itself (its fp16 main-to-model
    copy runs through it): it gets the foreach one too."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    assert clip_grads.multi_tensor_scale_impl is optimizer_patches.multi_tensor_scale_impl
    assert megatron_optimizer.multi_tensor_scale_impl is optimizer_patches.multi_tensor_scale_impl
    assert clip_grads.l2_norm_impl is optimizer_patches.l2_norm_impl


def test_installed_multi_tensor_kernels_stay(gloo_world_of_one, monkeypatch, capsys):
    """Where apex or TE bound their kernels (a stand-in here), the entries leave them: nothing is
    replaced, nothing is said, and their status says they kept the kernels."""
    from megatron.core.optimizer import clip_grads

    def amp_c_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        raise AssertionError("a stand-in, never called")

    def amp_c_scale(chunk_size, noop_flag, tensor_lists, scale):
        raise AssertionError("a stand-in, never called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", amp_c_l2norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", amp_c_scale)
    optimizer_patches._say_foreach_serves.cache_clear()
    statuses = _apply_here()
    try:
        assert statuses[_NORM] == statuses[_SCALE] == KEPT_ORIGINAL
        assert clip_grads.l2_norm_impl is amp_c_l2norm
        assert clip_grads.multi_tensor_scale_impl is amp_c_scale
    finally:
        megatron_npu.restore()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("entry", [_NORM, _SCALE])
def test_the_entries_are_planned_on_cuda_alone(entry):
    """On cuda they are planned; on the other devices the plain ``optimizer.*`` entries serve."""
    version = megatron_core_version()
    assert plan_status(get_patch(entry), CUDA, version) == ("", "")
    for device in NON_CUDA:
        assert plan_status(get_patch(entry), device, version)[0] == NOT_FOR_DEVICE
        plain = entry.removesuffix("-cuda-fallback")
        assert plan_status(get_patch(plain), device, version) == ("", "")
