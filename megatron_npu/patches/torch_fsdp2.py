"""``--use-torch-fsdp2``: Megatron's wrapper around PyTorch's FSDP2 (``fully_shard``).

``TorchFullyShardedDataParallel`` builds its device mesh as ``DeviceMesh.from_group(group,
"cuda")``. FSDP2 itself is device-generic: it gathers and reduce-scatters through the process
group's backend (HCCL on the NPU, gloo on cpu and npu-emulated) and keeps the shards on the mesh's
device type. The one CUDA assumption is that name, so the module's ``DeviceMesh`` becomes one whose
``"cuda"`` is the active device; everything else of FSDP2 is PyTorch's own.

Two uses of FSDP2 fail in Megatron's own code, on a GPU as here, and :func:`problems` refuses them
at start-up with one line each instead of a traceback per rank after training began:

* megatron-core releases whose ``finalize_model_grads`` passes ``force_all_reduce`` to a
  ``TorchFullyShardedDataParallel.finish_grad_sync`` that does not take it (0.16-0.18) fail at
  the first step; a Megatron-LM whose ``get_model`` passes ``disable_bucketing`` to a wrapper that
  does not take it (core_v0.13) fails building the model;
* ``--save``/``--load``: Megatron's optimizer checkpoint matches states to parameters by the
  identity of ``to_local()``, which torch 2.13 returns anew for each call on a DTensor parameter,
  so the first save fails; and loaded in place, a resumed run does not continue the saved one
  (its per-parameter Adam step is not restored).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from megatron_npu.devices.torch_namespace import map_device
from megatron_npu.registry import Patch


class DeviceMeshOnTheActiveDevice:
    """``torch.distributed.DeviceMesh`` as Megatron's FSDP2 wrapper sees it: a ``"cuda"`` device
    type names the active device (``npu`` on the NPU, ``cpu`` on cpu and npu-emulated)."""

    @staticmethod
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, str(map_device(device_type)), *args, **kwargs)


def _takes(function: Any, name: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _passes(caller: Any, keyword: str) -> bool:
    """Whether ``caller``'s source passes the keyword argument ``keyword``."""
    return f"{keyword}=" in inspect.getsource(caller)


def problems(args: Any) -> list[str]:
    """What of Megatron-LM's ``args`` Megatron's FSDP2 path fails on, as ``"--option: why"``."""
    if not getattr(args, "use_torch_fsdp2", False):
        return []
    from megatron.core.distributed import TorchFullyShardedDataParallel, finalize_model_grads

    from megatron_npu.patcher import megatron_core_version

    found = []
    training = sys.modules.get("megatron.training.training")
    get_model = getattr(training, "get_model", None)
    if (
        get_model is not None
        and _passes(get_model, "disable_bucketing")
        and not _takes(TorchFullyShardedDataParallel.__init__, "disable_bucketing")
    ):
        found.append(
            f"--use-torch-fsdp2: Megatron-LM's get_model passes disable_bucketing to megatron-core "
            f"{megatron_core_version()}'s TorchFullyShardedDataParallel, which does not take it: "
            "Megatron fails building the model on any device"
        )
    if _takes(finalize_model_grads, "force_all_reduce") and not _takes(
        TorchFullyShardedDataParallel.finish_grad_sync, "force_all_reduce"
    ):
        release = megatron_core_version()
        found.append(
            f"--use-torch-fsdp2: megatron-core {release}'s finalize_model_grads passes "
            "force_all_reduce to TorchFullyShardedDataParallel.finish_grad_sync, which does not "
            "take it: Megatron fails at the first step on any device"
        )
    if getattr(args, "save", None) or getattr(args, "load", None):
        found.append(
            "--save/--load with --use-torch-fsdp2: Megatron's FSDP2 checkpoints do not round-trip "
            "(its optimizer checkpoint cannot match torch 2.13's DTensor shards to parameters, "
            "and a resumed run does not continue the saved one)"
        )
    return found


PATCHES = [
    Patch(
        id="torch-fsdp2.device-mesh",
        target="megatron.core.distributed.torch_fully_sharded_data_parallel.DeviceMesh",
        replacement=DeviceMeshOnTheActiveDevice,
        reason="Megatron's FSDP2 wrapper builds its mesh on 'cuda': build it on the active device",
        versions=">=0.13",
        check_signature=False,
        rebind_copies=False,
        parity_exempt="device plumbing, no numerics of its own: FSDP2's gathers and reductions "
        "are PyTorch's; the named test wraps Megatron's model with it (two ranks training "
        "against plain data parallelism: tests/megatron_lm/test_pretrain_gpt.py::"
        "test_torch_fsdp2_trains_as_data_parallel)",
        benchmark_exempt="runs once, when the model is wrapped",
        exempt_test="tests/patches/test_torch_fsdp2.py::"
        "test_torch_fsdp2_wraps_megatrons_model_on_the_active_device",
    ),
]
