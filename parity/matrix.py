"""The parity matrix, generated from the registry: patch x dtype x parallel size x device.

Nothing here is a hand-written list: every cell comes from a registry entry's parity case.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from megatron_npu.parity.case import Parallel, ParityCase, load_case
from megatron_npu.parity.metrics import dtype_name
from megatron_npu.parity.sampling import examples

from megatron_npu.devices.facts import CPU, NPU_EMULATED
from megatron_npu.registry import Patch, all_patches

#: Devices the matrix covers by default: what every machine can run.
DEFAULT_DEVICES = (CPU, NPU_EMULATED)


@dataclass(frozen=True)
class Cell:
    patch: Patch
    case: ParityCase
    device: str
    dtype: torch.dtype
    parallel: Parallel

    @property
    def id(self) -> str:
        return f"{self.patch.id}[{dtype_name(self.dtype)}-{self.parallel.label()}-{self.device}]"


def patches_with_cases() -> list[tuple[Patch, ParityCase]]:
    """The patches with a parity case that apply to the installed megatron-core (a patch for
    another release may target what does not exist here: tox runs each release's own)."""
    from megatron_npu.patcher import megatron_core_version

    version = megatron_core_version()
    return [
        (p, load_case(p.parity))
        for p in all_patches()
        if p.parity and p.applies_to_version(version)
    ]


def cells(devices: tuple[str, ...] = DEFAULT_DEVICES) -> list[Cell]:
    out = []
    for patch, case in patches_with_cases():
        for device in devices:
            if device not in patch.devices:
                continue
            for dtype in case.dtypes.get(device, ()):
                for parallel in case.parallel:
                    out.append(Cell(patch, case, device, dtype, parallel))
    return out


@cache
def case_examples(case_name: str, mode: str) -> tuple[dict, ...]:
    case = next(c for _, c in patches_with_cases() if c.name == case_name)
    return tuple(examples(case, mode))
