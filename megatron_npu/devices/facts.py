"""What the adaptor knows about each device by name, whether or not this machine has it.

The device names are defined here, once; every other module uses these constants. Each name has
one :class:`DeviceFacts`: the torch device type its tensors live on, its process-group backend,
whether it emulates another device's code path, the class of devices whose step times may be
compared with its own, how a run on it measures its peak memory, whether its ranks share one
host's compute, the GEMM sizes the peak probe tries on it, and how a profiler sees its kernels.
Commands that judge results from other machines (compare, reports) read these facts without
building the device; the :class:`~megatron_npu.devices.base.Device` built on this machine carries
the same object as its ``facts``. This module imports nothing, so any layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU = "cpu"
NPU = "npu"
#: the CPU running the NPU code path through :mod:`megatron_npu.testing.torch_npu_emulation`
NPU_EMULATED = "npu-emulated"
CUDA = "cuda"
#: Every device name the adaptor knows, in the order results list them.
DEVICE_ORDER = (CPU, NPU_EMULATED, NPU, CUDA)
DEVICES = frozenset(DEVICE_ORDER)
#: Devices where Megatron's CUDA assumptions must be replaced (everything but native CUDA).
NON_CUDA = DEVICES - {CUDA}
#: The devices that run the NPU code path (on torch_npu or its emulation).
NPU_DEVICES = (NPU, NPU_EMULATED)

#: ``memory_measure``: the accelerator allocator's peak, or the process's peak resident set
ALLOCATOR, RSS = "allocator", "rss"

_HOST_PROBE = (256, 512, 1024)
_ACCELERATOR_PROBE = (2048, 4096, 8192)


@dataclass(frozen=True)
class DeviceFacts:
    """The fixed facts of one device name."""

    name: str
    #: the torch device type its tensors live on
    torch_type: str
    #: the ``torch.distributed`` backend of its process groups
    dist_backend: str
    #: True where the device runs another device's code path on the host (npu-emulated)
    emulated: bool
    #: devices of one class may be timed against each other; None: never timed (emulation)
    speed_class: str | None
    #: how a run's peak memory is measured there (:data:`ALLOCATOR` or :data:`RSS`)
    memory_measure: str
    #: True where every rank shares one host's compute: a run's peak FLOP/s does not grow with
    #: its world size
    host_shared: bool
    #: square GEMM sizes the peak probe tries (the best rate over all of them is kept)
    probe_sizes: tuple[int, ...]
    #: the ``torch.profiler.ProfilerActivity`` that records its kernels (where torch_npu or CUDA
    #: registers it); None where the host does the work
    profiler_activity: str | None = None
    #: True where Nsight Systems' capture range (``cudaProfilerStart``/``Stop``) applies
    cuda_profiler_api: bool = False


FACTS: dict[str, DeviceFacts] = {
    CPU: DeviceFacts(CPU, "cpu", "gloo", False, "host CPU", RSS, True, _HOST_PROBE),
    NPU_EMULATED: DeviceFacts(NPU_EMULATED, "cpu", "gloo", True, None, RSS, True, _HOST_PROBE),
    NPU: DeviceFacts(
        NPU,
        "npu",
        "hccl",
        False,
        "accelerator",
        ALLOCATOR,
        False,
        _ACCELERATOR_PROBE,
        profiler_activity="PrivateUse1",
    ),
    CUDA: DeviceFacts(
        CUDA,
        "cuda",
        "nccl",
        False,
        "accelerator",
        ALLOCATOR,
        False,
        _ACCELERATOR_PROBE,
        profiler_activity="CUDA",
        cuda_profiler_api=True,
    ),
}


def facts(name: str) -> DeviceFacts:
    """The facts of device ``name`` (a ValueError naming the devices for any other name)."""
    try:
        return FACTS[name]
    except KeyError:
        raise ValueError(
            f"unknown device {name!r}: choose one of {', '.join(DEVICE_ORDER)}"
        ) from None


def emulated(name: str | None) -> bool:
    """Whether ``name`` runs another device's code path on the host (False for an unknown name)."""
    found = known(name)
    return found is not None and found.emulated


def known(name: str | None) -> DeviceFacts | None:
    """The facts of ``name``, or None for a name the adaptor does not know (a result written
    by another tool, or by a newer version of this one)."""
    return FACTS.get(name or "")
