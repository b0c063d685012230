"""The caching allocator's history calls, answered for the active device.

Megatron-LM's ``--record-memory-history`` (its model provider, and the snapshot it pickles to
``--memory-snapshot-path`` at each logged iteration) calls
``torch.cuda.memory._record_memory_history`` in torch's legacy boolean form,
``torch.cuda.memory._snapshot`` / ``_dump_snapshot``, and
``torch._C._cuda_attach_out_of_memory_observer``. Transparent mode binds those names to a
:class:`MemoryHistory`:

* :class:`NpuMemoryHistory`: torch_npu's caching allocator records the same history. Its
  ``torch.npu.memory._record_memory_history`` takes only the keyword form (``enabled``,
  ``context``, ``stacks``, ``max_entries``), so a boolean call is translated the way torch's own
  legacy entry point reads it; the out-of-memory observer goes to
  ``torch_npu._C._npu_attach_out_of_memory_observer``.
* :class:`HostMemoryHistory` (cpu, npu-emulated): tensors come from the host allocator, which
  keeps no history. Recording says so in one line; a snapshot is torch's format with no segments
  and no trace events, so the script still writes its snapshot files and PyTorch's memory_viz
  opens them. An out-of-memory observer is accepted and never called: the host has no
  allocator out-of-memory event to report.
* :class:`CudaMemoryHistory`: torch's own, for ``megatron-npu train --record-memory-history``
  on ``cuda`` (transparent mode leaves ``cuda`` untouched).

:func:`of` gives a device's.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from megatron_npu import console

#: ``torch.cuda.memory`` names a :class:`MemoryHistory` answers
MEMORY_API = ("_record_memory_history", "_snapshot", "_dump_snapshot")
#: ``torch._C``'s name for attaching an out-of-memory observer
OOM_OBSERVER_API = "_cuda_attach_out_of_memory_observer"


def keyword_form(enabled: Any = "all", *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``_record_memory_history``'s arguments as the keyword form's ``enabled``, ``context``,
    ``stacks`` and ``max_entries`` (plus ``device`` when given).

    A boolean ``enabled`` is torch's legacy form ``(enabled, record_context=True,
    trace_alloc_max_entries=1, trace_alloc_record_context=False, device=None,
    record_context_cpp=False)``, read as torch's C++ reads it: alloc/free events are traced when
    more than one entry is kept; stacks are kept for allocations (``trace_alloc_record_context``),
    else for the live state (``record_context``); C++ frames only with ``record_context_cpp``."""
    if not isinstance(enabled, bool):
        names = ("context", "stacks", "max_entries", "device")
        return {"enabled": enabled, **dict(zip(names, args, strict=False)), **kwargs}
    names = (
        "record_context",
        "trace_alloc_max_entries",
        "trace_alloc_record_context",
        "device",
        "record_context_cpp",
    )
    legacy = {
        "record_context": True,
        "trace_alloc_max_entries": 1,
        "trace_alloc_record_context": False,
        "device": None,
        "record_context_cpp": False,
        **dict(zip(names, args, strict=False)),
        **kwargs,
    }
    if not enabled:
        return {"enabled": None}
    traced = legacy["trace_alloc_max_entries"] > 1
    if legacy["trace_alloc_record_context"]:
        context = "alloc"
    elif legacy["record_context"]:
        context = "state"
    else:
        context = None
    form = {
        "enabled": "all" if traced else "state",
        "context": context,
        "stacks": "all" if legacy["record_context_cpp"] else "python",
        "max_entries": max(int(legacy["trace_alloc_max_entries"]), 1),
    }
    if legacy["device"] is not None:
        form["device"] = legacy["device"]
    return form


class MemoryHistory:
    """What ``torch.cuda.memory``'s history calls do on one device."""

    def _record_memory_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        raise NotImplementedError

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        snapshot = self._snapshot()
        with open(filename, "wb") as out:
            pickle.dump(snapshot, out)

    def attach_out_of_memory_observer(self, observer: Any) -> None:
        raise NotImplementedError


class HostMemoryHistory(MemoryHistory):
    """A host-only device: no caching allocator, so no history (see the module docstring)."""

    def __init__(self, device_name: str) -> None:
        self.device_name = device_name
        self._said = False

    def _record_memory_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        if keyword_form(enabled, *args, **kwargs)["enabled"] is None or self._said:
            return
        self._said = True
        if os.environ.get("RANK", "0") != "0":  # said once per run
            return
        console.say(
            f"megatron-npu: the {self.device_name} device has no caching allocator, so memory "
            "history records nothing; its snapshots hold no segments and no trace events"
        )

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        return {"segments": [], "device_traces": [[]]}

    def attach_out_of_memory_observer(self, observer: Any) -> None:
        return None  # the host allocator has no out-of-memory event to report


class NpuMemoryHistory(MemoryHistory):
    """torch_npu's allocator history behind torch.cuda's spellings. Its functions are taken when
    the device is made, before transparent mode binds torch.cuda's names (torch_npu's own transfer
    module may have made ``torch.cuda.memory`` torch_npu's)."""

    def __init__(self, npu_module: Any, torch_npu_c: Any) -> None:
        memory = getattr(npu_module, "memory", None)
        self._functions = {
            "torch.npu.memory._record_memory_history": getattr(
                memory, "_record_memory_history", None
            ),
            "torch.npu.memory._snapshot": getattr(memory, "_snapshot", None),
            "torch.npu.memory._dump_snapshot": getattr(memory, "_dump_snapshot", None),
            "torch_npu._C._npu_attach_out_of_memory_observer": getattr(
                torch_npu_c, "_npu_attach_out_of_memory_observer", None
            ),
        }

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        function = self._functions[name]
        if function is None:
            raise RuntimeError(
                f"this torch_npu has no {name}: Megatron-LM's --record-memory-history needs a "
                "torch_npu whose caching allocator records history"
            )
        return function(*args, **kwargs)

    def _record_memory_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        self._call(
            "torch.npu.memory._record_memory_history", **keyword_form(enabled, *args, **kwargs)
        )

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        return self._call("torch.npu.memory._snapshot")

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        self._call("torch.npu.memory._dump_snapshot", filename)

    def attach_out_of_memory_observer(self, observer: Any) -> None:
        self._call("torch_npu._C._npu_attach_out_of_memory_observer", observer)


class CudaMemoryHistory(MemoryHistory):
    """torch's CUDA allocator history, as torch ships it."""

    def _record_memory_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        torch.cuda.memory._record_memory_history(enabled, *args, **kwargs)

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        return torch.cuda.memory._snapshot(device)

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        torch.cuda.memory._dump_snapshot(filename)

    def attach_out_of_memory_observer(self, observer: Any) -> None:
        torch._C._cuda_attach_out_of_memory_observer(observer)


def of(device: Any) -> MemoryHistory:
    """``device``'s allocator history: its accelerator's, torch's own on ``cuda``."""
    history = getattr(device.accelerator, "memory_history", None)
    return history if history is not None else CudaMemoryHistory()
