"""The state torch's Adam(W) creates at its first update, given to parameters that have none yet.

torch's Adam(W) creates a parameter's state (a zero ``step``, ``exp_avg`` and ``exp_avg_sq``)
at the first update that reaches it. Until then the state is empty, and checkpointing stumbles
on the gap: a run whose updates were all skipped so far (fp16 while the loss scale backs off
from 2**32, on any device) saves a distributed-optimizer checkpoint without moments, which the
resumed run cannot load (megatron-core asks for ``exp_avg``); and a fresh optimizer has no
state for a checkpoint's to land in. The zeros
are exactly what the next update would create, so giving them changes no number: the saved run
and its resume stay the same.

Only torch's Adam(W) state layout is given (the optimizer Megatron builds for ``--optimizer
adam`` without apex or Transformer Engine); the callers say where that layout holds.
"""

from __future__ import annotations

from typing import Any

import torch


def _zero_state(param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """What torch's Adam(W) creates for ``param`` at its first update (``step`` on the
    parameter's device where the group is fused or capturable, as torch keeps it)."""
    on_device = group.get("fused") or group.get("capturable")
    state = {
        "step": torch.zeros((), dtype=torch.float32, device=param.device if on_device else None),
        "exp_avg": torch.zeros_like(param.data, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param.data, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(param.data, memory_format=torch.preserve_format)
    return state


def give_missing_state(optimizer: Any) -> bool:
    """Give each parameter of ``optimizer`` (a torch Adam(W), or anything with its
    ``param_groups``/``state`` layout) without state the state of its first update. Returns
    whether any was given."""
    given = False
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state.get(param):
                optimizer.state[param] = _zero_state(param, group)
                given = True
    return given
