"""Run an op through each of its paths: native, the NPU binding on the emulation, and the
public dispatcher with the emulation installed via ``use_npu_kernels``."""

from __future__ import annotations

import contextlib

import pytest

from megatron_npu.ops.kernels import npu_kernels, use_npu_kernels
from megatron_npu.testing import torch_npu_emulation as emulation

PATHS = ("native", "npu", "dispatch")
FLOAT_DTYPES_NAMES = ("float32", "float16", "bfloat16")


@contextlib.contextmanager
def emulated_kernels():
    """Install the emulation as the kernel module; always put back the native path."""
    use_npu_kernels(emulation)
    try:
        yield emulation
    finally:
        use_npu_kernels(None)


def run(path: str, public, native, npu, *args, **kwargs):
    if path == "native":
        return native(*args, **kwargs)
    if path == "npu":
        return npu(emulation, *args, **kwargs)
    with emulated_kernels():
        return public(*args, **kwargs)


@pytest.fixture(autouse=True)
def native_kernels_around_each_test():
    """Every test starts and ends on the native path (imported by each test module)."""
    use_npu_kernels(None)
    yield
    assert npu_kernels() is None, "a test left an NPU kernel module installed"
    use_npu_kernels(None)


@pytest.fixture
def npu_emulated():
    """The public ops dispatch to the emulation for the test's duration."""
    use_npu_kernels(emulation)
    yield emulation
    use_npu_kernels(None)
