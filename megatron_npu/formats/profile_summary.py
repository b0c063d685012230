"""``summary-rank<R>.json``: what the torch profiler saw in the steps ``train --profile
--use-pytorch-profiler`` profiled on one rank (``training/profiling.py`` writes it beside the
rank's Chrome trace), and the same figures of any step profiled the same way (the GPU check's
plain PyTorch twin).

It answers where a slow step's time goes: kernel time well below the wall time points at the
host (launches, device reads that make the host wait); a few kernels holding most of the kernel
time point at them.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, NonNegativeFloat, NonNegativeInt

from megatron_npu.formats.base import Document, Part

SCHEMA = "megatron-npu/profile-summary"


class ProfiledOp(Part):
    """One op or kernel name, summed over the profiled steps."""

    name: str = Field(description="the op (aten::...) or device kernel, as the profiler names it")
    calls: NonNegativeInt = Field(description="how many times it ran in the profiled steps")
    host_s: NonNegativeFloat = Field(description="its self time on the host, seconds")
    device_s: NonNegativeFloat = Field(description="its self time on the device, seconds")


class ProfileSummary(Document):
    """The profiled steps of one process: per-step means and the ops that took the time."""

    schema_name: ClassVar[str] = "profile-summary"
    # the file's key is "schema", which pydantic's BaseModel holds as a method name
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)
    schema_: Literal["megatron-npu/profile-summary"] = Field(
        SCHEMA, alias="schema", description=f"always {SCHEMA!r}"
    )
    version: Literal[1] = 1
    what: str = Field(description="what ran the steps (megatron-npu train, a plain twin)")
    device: str = Field(description="the device the steps ran on")
    rank: NonNegativeInt = Field(0, description="the rank that profiled")
    steps: list[int] = Field(description="the profiled steps (1-based, as train counts them)")
    wall_s_per_step: NonNegativeFloat = Field(
        description="median wall time of a profiled step, device synchronised at both ends "
        "(the profiler's own cost included)"
    )
    device_kernel_s_per_step: NonNegativeFloat | None = Field(
        description="device kernel time per step, summed over the kernels (kernels of streams "
        "that overlap add up; the profiler's user-annotation ranges are left out); null where "
        "the profiler records no device activity (cpu)"
    )
    device_kernels_per_step: NonNegativeFloat | None = Field(
        description="device kernels per step; null where none are recorded (cpu)"
    )
    host_ops_per_step: NonNegativeFloat = Field(
        description="aten ops per step on the host, nested calls included"
    )
    device_reads_per_step: NonNegativeFloat = Field(
        description="reads of a tensor's value to the host per step (aten::_local_scalar_dense: "
        ".item(), float(), bool() of a tensor), host tensors' included: a read of a device "
        "tensor waits for the device's queue to drain"
    )
    top: list[ProfiledOp] = Field(
        description="the ops that took the most time (device time where recorded, else host "
        "time), most first"
    )
    trace: str | None = Field(None, description="the Chrome trace file beside this one, if any")


DOCUMENTS = (ProfileSummary,)
