"""``count_kernel_calls`` counts emulated torch_npu kernel calls, and only those, by name."""

from __future__ import annotations

import torch

from megatron_npu.ops import swiglu as swiglu_op
from megatron_npu.ops.kernels import npu_kernels, use_npu_kernels
from megatron_npu.testing import torch_npu_emulation as emulation


def test_counts_each_kernel_by_name_only_inside_the_block():
    x = torch.randn(4, 8)
    emulation.npu_swiglu(x)  # outside: not counted anywhere
    with emulation.count_kernel_calls() as outer:
        emulation.npu_swiglu(x)
        with emulation.count_kernel_calls() as inner:
            emulation.npu_rms_norm(x, torch.ones(8))
        emulation.npu_swiglu(x)
    emulation.npu_swiglu(x)
    assert outer == {"npu_swiglu": 2, "npu_rms_norm": 1}
    assert inner == {"npu_rms_norm": 1}


def test_op_layer_calls_are_counted_and_native_paths_are_not():
    x = torch.randn(4, 8)
    before = npu_kernels()
    try:
        use_npu_kernels(emulation)
        with emulation.count_kernel_calls() as emulated:
            swiglu_op.swiglu(x)
        use_npu_kernels(None)
        with emulation.count_kernel_calls() as native:
            swiglu_op.swiglu(x)
    finally:
        use_npu_kernels(before)
    assert emulated == {"npu_swiglu": 1}
    assert native == {}


def test_every_public_kernel_is_counted():
    assert set(emulation.KERNELS) == {n for n in emulation.__all__ if n.startswith("npu_")}
    assert all(getattr(emulation, n).__wrapped__ for n in emulation.KERNELS)


def test_harness_counts_a_real_torch_npu_module_too():
    """An ``npu`` cell's kernels come from the real torch_npu: the harness wraps the same
    kernel names on whatever module the op layer uses, and puts them back."""
    import types

    from megatron_npu.parity.harness import kernel_calls

    real = types.ModuleType("torch_npu")
    raw = emulation.npu_swiglu.__wrapped__
    real.npu_swiglu = raw
    before = npu_kernels()
    try:
        use_npu_kernels(real)
        with kernel_calls() as counted:
            swiglu_op.swiglu(torch.randn(4, 8))
            swiglu_op.swiglu(torch.randn(4, 8))
    finally:
        use_npu_kernels(before)
    assert counted == {"npu_swiglu": 2}
    assert real.npu_swiglu is raw
