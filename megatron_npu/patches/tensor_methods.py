"""``Tensor.cuda()`` and Megatron's ``Tensor.type()`` string checks.

Megatron moves tensors with ``.cuda()`` (optimizer state loading, grad scaler, shared embeddings)
and checks parameter types by string (``param.type() == 'torch.cuda.FloatTensor'``) while building
mixed-precision optimizers and clipping gradients. ``.cuda()`` is redirected to the active device.
``Tensor.type()`` reports CUDA's spelling for active-device tensors only *inside* the Megatron
functions that compare those strings (a context variable scopes it), so user code calling
``.type()`` elsewhere sees torch's real answer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import torch

from megatron_npu import devices
from megatron_npu.registry import Patch

_cuda_type_spelling = contextvars.ContextVar("megatron_npu_cuda_type_spelling", default=False)


@contextlib.contextmanager
def cuda_type_spelling():
    """Within this block ``Tensor.type()`` on active-device tensors reads ``torch.cuda.*``."""
    token = _cuda_type_spelling.set(True)
    try:
        yield
    finally:
        _cuda_type_spelling.reset(token)


def _wrap_tensor_type(original: Any) -> Any:
    @functools.wraps(original)
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any):
        if dtype is not None or kwargs or non_blocking:
            return original(self, dtype, non_blocking, **kwargs)
        name = original(self)
        active = devices.active()
        if _cuda_type_spelling.get() and active and self.device.type == active.torch_type:
            return "torch.cuda." + name.rsplit(".", 1)[-1]
        return name

    return type_


def _wrap_in_cuda_type_scope(original: Any) -> Any:
    @functools.wraps(original)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with cuda_type_spelling():
            return original(*args, **kwargs)

    return scoped


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any):
    """``Tensor.cuda()`` lands on the active device."""
    return self.to(devices.current_torch_device(), non_blocking=non_blocking)


_SCOPED = (
    ("scope.clip-grads", "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32"),
    (
        "scope.distopt-param-groups",
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
        "_build_model_and_main_param_groups",
    ),
    (
        "scope.distopt-init",
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
    ),
    (
        "scope.fp16-optimizer-init",
        "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    ),
)

_EXEMPT = "type/placement plumbing, no numerics of its own"
_DEVICES_TEST = "tests/test_devices.py::"
_PLUMBING_TEST = "tests/patches/test_exempt_plumbing.py::test_megatron_optimizers_build_on_cpu"
#: the test that fails without each scoped entry
_SCOPED_TESTS = {
    "scope.clip-grads": _DEVICES_TEST + "test_megatron_grad_clip_type_check_passes_on_cpu",
    "scope.distopt-param-groups": _PLUMBING_TEST + "[distributed-optimizer]",
    "scope.distopt-init": _PLUMBING_TEST + "[distributed-optimizer]",
    "scope.fp16-optimizer-init": _PLUMBING_TEST + "[float16-optimizer]",
}

PATCHES = [
    Patch(
        id="tensor.cuda",
        target="torch.Tensor.cuda",
        replacement=_tensor_cuda,
        reason="Tensor.cuda() in Megatron must land on the active device",
        check_signature=False,
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_DEVICES_TEST + "test_tensor_cuda_and_scoped_type_names",
    ),
    Patch(
        id="tensor.type",
        target="torch.Tensor.type",
        replacement=_wrap_tensor_type,
        kind="wrap",
        reason="report torch.cuda.* type names inside Megatron's type-string checks only",
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_DEVICES_TEST + "test_tensor_cuda_and_scoped_type_names",
    ),
] + [
    Patch(
        id=pid,
        target=target,
        replacement=_wrap_in_cuda_type_scope,
        kind="wrap",
        reason="compares Tensor.type() against 'torch.cuda.*' names",
        versions=">=0.13",
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_SCOPED_TESTS[pid],
    )
    for pid, target in _SCOPED
]
