"""The optimizer classes a ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) checkpoint
holds, as the globals torch's ``weights_only`` load is allowed to read.

megatron-core's ``HybridDeviceOptimizer`` keeps the classes of its two optimizers in its defaults,
so every parameter group it saves holds them (``cpu_optimizer_cls``: torch's AdamW or SGD;
``gpu_optimizer_cls``: Megatron's ``Adam`` or ``SGD``, which are Transformer Engine's or apex's
fused optimizers where installed, else torch's AdamW and SGD, and the adaptor's
:class:`~megatron_npu.optim.precision_aware.MegatronAdam` while its ``optimizer.adam`` entry is
applied). A checkpoint written where TE or apex was installed (a GPU cluster) names classes this
machine may lack: where the named module is not loaded, the name reads as the class that serves
it here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

#: The fused optimizers Megatron records where Transformer Engine or apex is installed, by their
#: pickled names, and which of Megatron's names (``megatron.core.optimizer.Adam``/``SGD``) serves
#: each here.
FUSED_OPTIMIZERS = {
    "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam": "Adam",
    "transformer_engine.pytorch.optimizers.fused_sgd.FusedSGD": "SGD",
    "apex.optimizers.fused_adam.FusedAdam": "Adam",
    "apex.optimizers.fused_sgd.FusedSGD": "SGD",
}


def recorded_optimizer_classes() -> list[Any]:
    """The globals ``torch.serialization.safe_globals`` takes for the optimizer classes a
    ``HybridDeviceOptimizer`` checkpoint may hold: classes, or ``(class, pickled name)`` for a
    fused optimizer whose module is not loaded in this process. megatron-core's optimizer module
    is read where it is loaded (not imported for this)."""
    from megatron_npu.optim.precision_aware import MegatronAdam

    megatron = sys.modules.get("megatron.core.optimizer")
    serving = {
        "Adam": getattr(megatron, "Adam", MegatronAdam),
        "SGD": getattr(megatron, "SGD", torch.optim.SGD),
    }
    allowed: list[Any] = [torch.optim.AdamW, torch.optim.SGD, MegatronAdam, *serving.values()]
    for name, serves in FUSED_OPTIMIZERS.items():
        module, _, attribute = name.rpartition(".")
        loaded = getattr(sys.modules.get(module), attribute, None)
        allowed.append(loaded or (serving[serves], name))
    return allowed
