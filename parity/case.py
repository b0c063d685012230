"""What a parity case is: the OpInfo-style description attached to a registry patch.

A patch names its case by reference
(``Patch.parity = "megatron_npu.parity.cases.norm:WRAPPED_TORCH_NORM"``) so the adaptor never
imports the harness at run time; :func:`load_case` resolves it.

A case says how to make inputs (a hypothesis strategy of parameter dicts plus explicit edge
cases), how to run the patched path on the device under test, how to compute the reference on the
CPU with inputs upcast (fp16/bf16 -> fp32, fp32 -> fp64), which outputs and gradients are
compared, which dtypes each device supports, which parallel sizes are meaningful, and any
tolerance override with its written reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron_npu.parity.verdict import Tolerance

from megatron_npu.devices.facts import DEVICE_ORDER

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: What each device can compute in. The NPU has no fp64, which only the reference uses.
DEFAULT_DTYPES: Mapping[str, tuple[torch.dtype, ...]] = {d: ALL_DTYPES for d in DEVICE_ORDER}


@dataclass(frozen=True, order=True)
class Parallel:
    """Parallel sizes of one run: tensor, pipeline, data and context parallel."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "world": self.world}

    def label(self) -> str:
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        return f"tp{self.tp}-pp{self.pp}-dp{self.dp}{cp}"


def upcast(dtype: torch.dtype) -> torch.dtype:
    """The reference precision for ``dtype`` (msprobe's rule)."""
    return torch.float64 if dtype == torch.float32 else torch.float32


@dataclass
class Context:
    """Everything a case's ``run`` / ``reference`` may need for one example.

    ``dtype`` is the precision of this call (the tested dtype for ``run``, its upcast for
    ``reference``); ``device`` where tensors go; ``original`` the pristine Megatron object the
    patch replaced (a device-neutral reference calls it); ``rank``/``parallel`` describe the
    process group layout (rank 0 of 1 for single-process cases).
    """

    params: dict[str, Any]
    dtype: torch.dtype
    tested_dtype: torch.dtype
    device: torch.device
    original: Any
    parallel: Parallel = Parallel()
    rank: int = 0

    def tensor(self, t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """``t`` (fp64 master values) as this call sees it, optionally as a grad leaf.

        Floating inputs are first rounded to the *tested* dtype, so the reference gets exactly
        the tested path's inputs, upcast: only the computation's error is measured.
        """
        if t.is_floating_point():
            out = t.to(self.tested_dtype).to(device=self.device, dtype=self.dtype)
        else:
            out = t.to(self.device)
        return out.requires_grad_(grad) if grad else out

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """A floating tensor rounded like :meth:`tensor` but left on the CPU in fp64 (for
        copying into module parameters before the module is cast)."""
        return t.to(self.tested_dtype).to(torch.float64)


Outputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ParityCase:
    """One patch's parity description.

    ``make_inputs(params) -> dict`` builds fp64 master tensors (deterministic from
    ``params["seed"]``); ``run(ctx, inputs)`` and ``reference(ctx, inputs)`` return named outputs
    and gradients (``out``, ``grad_x``, ...) on rank 0 — full, un-sharded tensors.
    """

    name: str
    params: Any  # hypothesis strategy of parameter dicts
    make_inputs: Callable[[dict[str, Any]], dict[str, torch.Tensor]]
    run: Callable[[Context, dict[str, torch.Tensor]], Outputs]
    reference: Callable[[Context, dict[str, torch.Tensor]], Outputs]
    compares: str
    edge_cases: tuple[dict[str, Any], ...] = ()
    dtypes: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=lambda: DEFAULT_DTYPES)
    parallel: tuple[Parallel, ...] = (Parallel(),)
    tolerance: Tolerance | None = None
    tolerance_by_dtype: Mapping[torch.dtype, Tolerance] = field(default_factory=dict)
    reference_kind: str = "original Megatron function on CPU, inputs upcast"
    #: True for a case that runs a whole Megatron module (e.g. the MoE layer): on its way it
    #: reaches the kernels other patches declare, besides its own patch's
    whole_module: bool = False

    def __post_init__(self) -> None:
        if not self.compares.strip():
            raise ValueError(f"parity case {self.name!r}: say what is compared")
        for p in self.parallel:
            if p.world < 1:
                raise ValueError(f"parity case {self.name!r}: bad parallel size {p}")

    def tolerance_for(self, dtype: torch.dtype) -> Tolerance | None:
        return self.tolerance_by_dtype.get(dtype, self.tolerance)

    def supports(self, device: str, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes.get(device, ())


def load_case(ref: str) -> ParityCase:
    """Resolve ``"package.module:NAME"`` to the :class:`ParityCase` it names."""
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"parity reference {ref!r} must look like 'module:NAME'")
    case = getattr(importlib.import_module(module_name), attr)
    if not isinstance(case, ParityCase):
        raise TypeError(f"parity reference {ref!r} is a {type(case).__name__}, not a ParityCase")
    return case
