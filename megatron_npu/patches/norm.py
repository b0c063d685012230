"""Megatron's local-spec norm (``WrappedTorchNorm``) -> :class:`megatron_npu.modules.norm.Norm`.

The stock class asserts ``not config.sequence_parallel`` (torch's LayerNorm has no SP support),
which makes TP+SP impossible without apex; the replacement supports SP and routes to the NPU's
``npu_rms_norm`` / layer-norm kernels.
"""

from __future__ import annotations

from megatron_npu.modules.norm import from_megatron_config
from megatron_npu.registry import Patch


def __new__(
    cls,
    config,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
):
    """Build megatron-npu's Norm from Megatron's config (same arguments as the original)."""
    return from_megatron_config(config, hidden_size, eps)


PATCHES = [
    Patch(
        id="norm.wrapped-torch-norm",
        target="megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
        replacement=__new__,
        reason="stock norm refuses sequence parallelism; route LayerNorm/RMSNorm to the op layer",
        versions=">=0.13",
        parity="megatron_npu.parity.cases.norm:WRAPPED_TORCH_NORM",
        benchmark="perf.cases.layers:RMS_NORM",
        npu_kernels=("npu_rms_norm",),
        builds=("megatron_npu.modules.norm.Norm",),
    ),
]
