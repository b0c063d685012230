"""Megatron-LM's ``--profile``: a window of training steps profiled on the ranks
``--profile-ranks`` names.

The window is Megatron-LM's (:func:`~megatron_npu.training.arguments.profile_window`; defaults
10 and 12): steps START..END-1 (counted from 1, from step 1 at the earliest) with its torch
profiler, START+1..END with Nsight's capture range.

* ``--use-pytorch-profiler`` (any device): the torch profiler records the window, host and device
  activity, with shapes. Each profiling rank writes ``trace-rank<R>.json`` (Chrome trace format:
  Perfetto, ``chrome://tracing``) and ``summary-rank<R>.json``
  (:class:`~megatron_npu.formats.profile_summary.ProfileSummary`: the device's kernel time
  against the wall time, kernels, host ops, device reads and the ops that took the time) into
  ``--profile-dir``.
* without it, on ``cuda``: Megatron-LM's capture range for Nsight Systems
  (``cudaProfilerStart``/``Stop`` around the window, NVTX ranges per op), run under
  ``nsys profile --capture-range=cudaProfilerApi``; nothing is written here.
* without it, elsewhere: the capture range is CUDA's, so the torch profiler records its window
  (START+1..END), as with ``--use-pytorch-profiler``, and one line says so.

The profiler starts with the window's first step (Megatron-LM's schedule runs it one warm-up
step earlier); the profiled steps run slower by the profiler's own cost, and their times stay in
the step records.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_npu import console
from megatron_npu.devices.facts import DeviceFacts
from megatron_npu.files import make_dir
from megatron_npu.formats.profile_summary import SCHEMA, ProfiledOp, ProfileSummary
from megatron_npu.training.arguments import profile_window

#: the op a read of a tensor's value to the host runs (``.item()``, ``float()``, ``bool()``)
DEVICE_READ = "aten::_local_scalar_dense"
#: how many ops a summary lists
TOP = 25


def recorder(device: DeviceFacts) -> torch.profiler.profile:
    """A torch profiler of the host and, where torch has its activity, of ``device``'s kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    name = device.profiler_activity
    activity = getattr(torch.profiler.ProfilerActivity, name, None) if name else None
    if activity is not None and activity in torch.profiler.supported_activities():
        activities.append(activity)
    return torch.profiler.profile(activities=activities, record_shapes=True)


def summarize(
    prof: torch.profiler.profile,
    *,
    what: str,
    device: str,
    steps: Sequence[int],
    wall_s: Sequence[float],
    rank: int = 0,
    trace: str | None = None,
) -> ProfileSummary:
    """The figures of ``prof``, which recorded ``steps`` taking ``wall_s`` seconds each."""
    n = max(len(steps), 1)
    averages = prof.key_averages()
    # kernels only: a record_function range also shows on the device's timeline (a "user
    # annotation" spanning the kernels under it), which summed with them would count them twice
    on_device = [
        a
        for a in averages
        if a.device_type != torch.autograd.DeviceType.CPU and not a.is_user_annotation
    ]
    on_host = [a for a in averages if a.device_type == torch.autograd.DeviceType.CPU]
    counts = Counter({a.key: a.count for a in on_host})
    ranked = (
        sorted(on_device, key=lambda a: a.self_device_time_total, reverse=True)
        if on_device
        else sorted(on_host, key=lambda a: a.self_cpu_time_total, reverse=True)
    )
    return ProfileSummary(
        schema=SCHEMA,
        version=1,
        what=what,
        device=device,
        rank=rank,
        steps=list(steps),
        wall_s_per_step=statistics.median(wall_s) if wall_s else 0.0,
        device_kernel_s_per_step=(
            sum(a.self_device_time_total for a in on_device) / 1e6 / n if on_device else None
        ),
        device_kernels_per_step=sum(a.count for a in on_device) / n if on_device else None,
        host_ops_per_step=sum(c for k, c in counts.items() if k.startswith("aten::")) / n,
        device_reads_per_step=counts[DEVICE_READ] / n,
        top=[
            ProfiledOp(
                name=a.key,
                calls=a.count,
                host_s=a.self_cpu_time_total / 1e6,
                device_s=a.self_device_time_total / 1e6,
            )
            for a in ranked[:TOP]
        ],
        trace=trace,
    )


class StepProfiler:
    """``--profile`` for one rank of a training loop: :meth:`starting` before each step,
    :meth:`finished` after it, :meth:`close` when the loop ends (module docstring)."""

    def __init__(self, args: Any, device: Any, rank: int) -> None:
        profiled = args.profile and rank in args.profile_ranks
        self.steps = profile_window(args) if profiled else range(0)
        self.rank, self.device = rank, device
        self.folder = Path(args.profile_dir)
        self.nsys = device.facts.cuda_profiler_api and not args.use_pytorch_profiler
        if self.steps and not self.nsys and not args.use_pytorch_profiler:
            console.warn(
                f"megatron-npu: --profile without --use-pytorch-profiler asks for Nsight "
                f"Systems' capture range, which is CUDA's; on {device.name} the torch profiler "
                f"records steps {self.steps[0]}..{self.steps[-1]} into {self.folder}"
            )
        self._opened = False
        self._prof: torch.profiler.profile | None = None
        self._nvtx: Any = None
        self._wall: list[float] = []
        self._seen: list[int] = []

    def starting(self, step: int) -> None:
        """Open the window at its first step this run trains (a resumed run may start inside)."""
        if self._opened or step not in self.steps:
            return
        self._opened = True
        if self.nsys:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
            return
        self._prof = recorder(self.device.facts)
        self._prof.__enter__()

    def finished(self, step: int, elapsed_s: float) -> None:
        if step not in self.steps:
            return
        self._wall.append(elapsed_s)
        self._seen.append(step)
        if step == self.steps[-1]:
            self.close()

    def close(self) -> None:
        """Stop the window (also when the run ends inside it) and write what it recorded; say
        so when the run trained none of its steps (it resumed past them, or stopped before)."""
        if self.steps and not self._opened:
            console.warn(
                f"megatron-npu: --profile: this run trained none of steps "
                f"{self.steps[0]}..{self.steps[-1]}; nothing was profiled"
            )
            self.steps = range(0)
            return
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.cudart().cudaProfilerStop()
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        make_dir(self.folder)
        trace = self.folder / f"trace-rank{self.rank}.json"
        partial = trace.with_name(f".{trace.name}.{os.getpid()}")
        prof.export_chrome_trace(str(partial))
        os.replace(partial, trace)
        summary = summarize(
            prof,
            what="megatron-npu train",
            device=self.device.name,
            steps=self._seen,
            wall_s=self._wall,
            rank=self.rank,
            trace=trace.name,
        )
        summary.write(self.folder / f"summary-rank{self.rank}.json")
        console.say(f" profile of steps {self._seen}: {trace} and its summary")
