"""The state torch's Adam(W) creates at its first update, given to parameters that have none yet.

torch's Adam(W) creates a parameter's state (a zero ``step``, ``exp_avg`` and ``exp_avg_sq``)
at the first update that reaches it. Until then the state is empty, and checkpointing stumbles
on the gap: a run whose updates were all skipped so far (fp16 while the loss scale backs off
from its start) saves a distributed-optimizer checkpoint without moments, which the resumed
run cannot load (megatron-core asks for ``exp_avg``), or, in the legacy ``--ckpt-format
torch``, does not save at all; and a fresh optimizer has no state for the checkpoint's state to
be loaded into. The zeros are exactly what the next update would create, so giving them changes
no number: the saved run and its resume stay the same.

Only torch's Adam(W) (and subclasses, such as the adaptor's fused AdamW) is given state here;
callers decide which optimizer that is (Transformer Engine's and apex's fused Adam keep other
state layouts and are never passed).
"""

from __future__ import annotations

from typing import Any

import torch


def _zero_state(param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """What torch's Adam(W) creates for ``param`` at its first update: ``step`` on the
    parameter's device in float32 where the group is fused or capturable, else on the host in
    the default float type's precision (float64 only under a float64 default), as torch keeps
    it."""
    if group.get("fused") or group.get("capturable"):
        step = torch.zeros((), dtype=torch.float32, device=param.device)
    else:
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        step = torch.tensor(0.0, dtype=dtype, device="cpu")
    state = {
        "step": step,
        "exp_avg": torch.zeros_like(param.data, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param.data, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(param.data, memory_format=torch.preserve_format)
    return state


def is_torch_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps torch's Adam(W) state layout (torch's classes and theirs)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


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
