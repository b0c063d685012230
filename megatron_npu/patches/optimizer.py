"""Megatron's optimizer kernels: Adam, the fp16 unscale/inf check, grad-norm and scale.

* ``megatron.core.optimizer.Adam`` (apex/TE ``FusedAdam``, else ``torch.optim.AdamW``) ->
  :class:`megatron_npu.optim.precision_aware.MegatronAdam`: the fused AdamW
  (:class:`megatron_npu.optim.adamw.FusedAdamW`), or the precision-aware one given TE's options.
* ``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan`` -> the op layer's
  non-finite check and unscale, then Megatron's MAX all-reduce over the grad-stats group.
* ``OptimizerConfig.__post_init__`` admits ``--use-precision-aware-optimizer`` without TE: the
  optimizer it asks for (TE's ``FusedAdam`` with master weights, low-precision moments and
  decoupled grads) is :class:`megatron_npu.optim.precision_aware.PrecisionAwareAdamW`, which
  the factory builds through the fused AdamW; megatron-core's "is TE at least 2.1?" there is
  answered for it (bf16 params keep their master as int16 remainders, Megatron's default).
* ``clip_grads.l2_norm_impl`` / ``multi_tensor_scale_impl`` (amp_C or Megatron's local
  fallback, which builds its result with ``device="cuda"``) -> the op layer's multi-tensor ops.

On ``cuda`` apex's and Transformer Engine's multi-tensor kernels stay where they are installed. A
GPU with neither gets Megatron's local fallbacks, which loop over the parameters in Python: the
gradient norm launches one norm per parameter and reads each back to the host
(``torch.tensor`` of a list of device scalars), so every step waits on the device once per
parameter, and clipping launches a multiply and a copy per parameter. ``*-cuda-fallback`` put
the same foreach ops in their place only where Megatron bound its local fallback: one device read
per step, a few launches, one line saying so. Every module that bound the same fallback gets them
too: ``megatron.core.optimizer.optimizer`` copies the fp16 main parameters to the model's through
``multi_tensor_scale_impl``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from megatron_npu import console, devices
from megatron_npu.devices.facts import CUDA
from megatron_npu.devices.torch_namespace import TorchNamespace
from megatron_npu.ops.multi_tensor import (
    check_finite_and_unscale_,
    multi_tensor_l2norm,
    multi_tensor_scale_,
)
from megatron_npu.optim.hybrid_offload import sub_optimizer_param_groups
from megatron_npu.optim.precision_aware import MegatronAdam
from megatron_npu.patches.transformer_engine import stand_in_te_min_version
from megatron_npu.registry import Patch


def _unscale_main_grads_and_check_for_nan(self):
    main_grads = [] if self.is_stub_optimizer else self._collect_main_grad_data_for_unscaling()
    self.found_inf.fill_(0.0)
    if main_grads:
        found = check_finite_and_unscale_(main_grads, self.grad_scaler.inv_scale)
        self.found_inf.copy_(found.to(self.found_inf.device).reshape(self.found_inf.shape))
    torch.distributed.all_reduce(
        self.found_inf,
        op=torch.distributed.ReduceOp.MAX,
        group=self.get_grad_stats_parallel_group(),
    )
    return self.found_inf.item() > 0


def l2_norm_impl(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm contract: ``(total_norm[1] fp32, per_tensor_norms | None)``."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, device=devices.current_torch_device()), None
    return multi_tensor_l2norm(tensors, per_tensor=per_tensor)


def multi_tensor_scale_impl(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale contract: ``dst = src * scale``; flags non-finite in noop_flag."""
    found = multi_tensor_scale_(tensor_lists[0], tensor_lists[1], scale)
    if noop_flag is not None and torch.is_tensor(noop_flag) and found is not None:
        noop_flag.copy_(torch.maximum(noop_flag, found.to(noop_flag).reshape(noop_flag.shape)))


def _without_te_fused_adam(exc: RuntimeError) -> bool:
    """Whether ``exc`` is the config's "precision-aware needs TE's FusedAdam" error: the
    RuntimeError megatron-core raises while handling the ImportError of
    ``transformer_engine``."""
    cause = exc.__context__
    return isinstance(cause, ImportError) and (cause.name or "").startswith("transformer_engine")


def _admit_precision_aware(original: Any) -> Any:
    """``OptimizerConfig.__post_init__`` whose last check, that TE's ``FusedAdam`` imports and
    takes the precision-aware options, is answered by :class:`PrecisionAwareAdamW` (megatron-core
    0.13-0.19 run every other check of the config before it)."""

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        try:
            original(self)
        except RuntimeError as exc:
            if not (self.use_precision_aware_optimizer and _without_te_fused_adam(exc)):
                raise

    return __post_init__


@functools.cache
def _say_foreach_serves() -> None:
    """One line per process: what serves in place of the missing multi-tensor kernels."""
    console.warn(
        "megatron-npu: neither apex's nor Transformer Engine's multi-tensor kernels are "
        "installed; torch's foreach kernels serve Megatron's gradient norm and clipping in place "
        "of its per-parameter fallback"
    )


def _where_megatron_fell_back(ours: Any, fallback: str):
    """A wrap that installs ``ours`` where the target is ``megatron.core.utils.<fallback>``
    (neither TE nor apex imported) and leaves any other kernel as it is."""

    def wrap(original: Any) -> Any:
        from megatron.core import utils

        if original is not getattr(utils, fallback, None):
            return original
        _say_foreach_serves()
        return ours

    return wrap


class _OptimWithFusedAdamW(ModuleType):
    """``torch.optim`` as megatron-core's optimizer factory sees it: ``AdamW`` is
    :class:`MegatronAdam` (the fused AdamW, or the precision-aware one given TE's options)."""

    AdamW = MegatronAdam

    def __init__(self) -> None:
        super().__init__("torch.optim", "torch.optim with megatron-npu's fused AdamW")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.optim, name)


class _TorchForOptimizerFactory(TorchNamespace):
    """Device routing plus ``torch.optim.AdamW`` -> :class:`MegatronAdam`.

    From megatron-core 0.15 the factory builds ``torch.optim.AdamW`` itself whenever apex and
    TransformerEngine are absent (instead of the module's ``Adam`` name), so the fused AdamW has
    to be reached through the module's ``torch``.
    """

    optim = _OptimWithFusedAdamW()


_CLIP = "megatron.core.optimizer.clip_grads"
_PRECISION_AWARE_TEST = (
    "tests/test_precision_aware_optimizer.py::"
    "test_megatron_builds_it_for_the_precision_aware_config"
)


def _cuda_fallback(
    entry: str, name: str, ours: Any, fallback: str, reason: str, test: str
) -> Patch:
    """``<entry>-cuda-fallback``: ``clip_grads.<name>`` is ``entry``'s kernel (``ours``) on a GPU
    where Megatron bound ``megatron.core.utils.<fallback>``; numerics and benchmark are
    ``entry``'s, and ``test`` fails with the entry off."""
    return Patch(
        id=f"{entry}-cuda-fallback",
        target=f"{_CLIP}.{name}",
        replacement=_where_megatron_fell_back(ours, fallback),
        kind="wrap",
        devices=frozenset({CUDA}),
        reason=f"a GPU without apex/TE: {reason} (amp_C/TE kernels stay)",
        versions=">=0.13",
        check_signature=False,
        parity_exempt=f"picks {entry}'s foreach kernel, whose numerics are that entry's parity "
        "case; the named test checks the device reads or launches it saves",
        benchmark_exempt=f"the kernel it picks is {entry}'s benchmark (path native against "
        "Megatron's loop)",
        exempt_test=f"tests/patches/test_optimizer_cuda_fallback.py::{test}",
    )


PATCHES = [
    Patch(
        id="optimizer.adam",
        target="megatron.core.optimizer.Adam",
        replacement=MegatronAdam,
        reason="apex/TE FusedAdam is CUDA-only: fused AdamW via npu_apply_adam_w / _fused_adamw_ "
        "(the factory's choice up to 0.14; 0.15+ see optimizer.factory-torch-adamw)",
        versions=">=0.13",
        rebind_copies=False,  # the fallback *is* torch.optim.AdamW: never rebind torch's own name
        parity="megatron_npu.parity.cases.optimizer:ADAMW",
        benchmark="perf.cases.optimizer:ADAMW",
        npu_kernels=("npu_apply_adam_w",),
    ),
    Patch(
        id="optimizer.factory-torch-adamw",
        target="megatron.core.optimizer.torch",
        replacement=_TorchForOptimizerFactory(),
        reason="0.15+ builds torch.optim.AdamW directly without apex/TE: route it to FusedAdamW",
        versions=">=0.15",
        check_signature=False,
        rebind_copies=False,
        benchmark_exempt="routing only: the AdamW it routes to is optimizer.adam's benchmark",
        parity_exempt="routing only: FusedAdamW's numerics are the optimizer.adam parity case; "
        "the named test checks get_megatron_optimizer builds it",
        exempt_test="tests/test_optimizer_routing.py::"
        "test_megatron_optimizer_is_the_fused_adamw_when_applied",
    ),
    Patch(
        id="optimizer.hybrid-device-offload-split",
        target="megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer."
        "_get_sub_optimizer_param_groups",
        replacement=sub_optimizer_param_groups,
        reason="--optimizer-cpu-offload tells accelerator parameters by is_cuda, False on an "
        "NPU and on the host-only devices: nothing was offloaded and the step failed",
        versions=">=0.13",
        parity_exempt="splits the parameters between two optimizers, no numerics of its own",
        exempt_test="tests/test_hybrid_offload.py::"
        "test_a_step_is_adamw_on_fp32_copies_for_both_halves[one-host-optimizer]",
        benchmark_exempt="runs once while the optimizer is built",
    ),
    Patch(
        id="optimizer.precision-aware-config",
        target="megatron.core.optimizer.optimizer_config.OptimizerConfig.__post_init__",
        replacement=_admit_precision_aware,
        kind="wrap",
        reason="--use-precision-aware-optimizer asks for TE's FusedAdam, which needs CUDA: "
        "PrecisionAwareAdamW keeps its master weights, low-precision moments and decoupled "
        "grads, through the fused AdamW step",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.optimizer:PRECISION_AWARE_ADAMW",
        benchmark="perf.cases.optimizer:PRECISION_AWARE_ADAMW",
        npu_kernels=("npu_apply_adam_w",),
    ),
    *(
        Patch(
            id=f"optimizer.precision-aware-te-version{suffix}",
            target=f"{module}.is_te_min_version",
            replacement=stand_in_te_min_version,
            rebind_copies=False,
            reason="megatron-core asks whether TE's FusedAdam is at least 2.1 (the int16 "
            "master remainders of bf16 params, Megatron's default): PrecisionAwareAdamW keeps "
            "them; without TE the question fails up to 0.16 and answers 'older' from 0.17",
            versions=">=0.13",
            parity_exempt="answers a version question, no numerics: the remainders it selects "
            "are in the precision-aware-adamw parity case",
            exempt_test=_PRECISION_AWARE_TEST,
            benchmark_exempt="read once while the optimizer is built",
        )
        for suffix, module in (
            ("", "megatron.core.optimizer.optimizer_config"),
            ("-factory", "megatron.core.optimizer"),
        )
    ),
    Patch(
        id="optimizer.unscale-and-check-nan",
        target="megatron.core.optimizer.optimizer.MixedPrecisionOptimizer."
        "_unscale_main_grads_and_check_for_nan",
        replacement=_unscale_main_grads_and_check_for_nan,
        reason="fp16 loss-scale unscale and inf/nan check through the op layer on the device",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.optimizer:UNSCALE_AND_CHECK",
        benchmark="perf.cases.optimizer:UNSCALE_AND_CHECK",
    ),
    Patch(
        id="optimizer.l2-norm",
        target=f"{_CLIP}.l2_norm_impl",
        replacement=l2_norm_impl,
        reason="gradient-norm kernel (amp_C or a device='cuda' fallback) -> foreach norm",
        versions=">=0.13",
        check_signature=False,  # amp_C's kernel has no Python signature
        parity="megatron_npu.parity.cases.optimizer:GRAD_NORM",
        benchmark="perf.cases.optimizer:L2_NORM",
    ),
    Patch(
        id="optimizer.multi-tensor-scale",
        target=f"{_CLIP}.multi_tensor_scale_impl",
        replacement=multi_tensor_scale_impl,
        reason="gradient-clipping scale kernel -> foreach scale with non-finite flag",
        versions=">=0.13",
        check_signature=False,
        parity="megatron_npu.parity.cases.optimizer:GRAD_CLIP_SCALE",
        benchmark="perf.cases.optimizer:MULTI_TENSOR_SCALE",
    ),
    *(
        _cuda_fallback(entry, name, ours, fallback, reason, test)
        for entry, name, ours, fallback, reason, test in (
            (
                "optimizer.l2-norm",
                "l2_norm_impl",
                l2_norm_impl,
                "local_multi_tensor_l2_norm",
                "Megatron's per-parameter norm loop reads the device once per parameter -> the "
                "foreach norm, one read per step",
                "test_the_norm_reads_the_device_once",
            ),
            (
                "optimizer.multi-tensor-scale",
                "multi_tensor_scale_impl",
                multi_tensor_scale_impl,
                "local_multi_tensor_scale",
                "Megatron's per-parameter scale loop (a multiply and a copy per parameter) -> "
                "the foreach scale",
                "test_clipping_launches_do_not_grow_with_the_parameters",
            ),
        )
    ),
]
