"""``--init-ulp-nudge K``: every initial weight moved K ulps of its own dtype, before training.

A rounding-level perturbation: the same model, data and arithmetic, every weight at the next
representable value (``torch.nextafter``, up for K > 0, down for K < 0). How far a run's curve
moves from its unperturbed twin measures what the configuration amplifies rounding into;
``compare``'s noise rule (:mod:`megatron_npu.compare.noise`) turns two such reruns into the band
a candidate on another device is judged against. It runs after the model is built and before the
optimizer copies the weights (its fp32 main copy of 16-bit weights starts from the nudged ones).

A user's Megatron-LM script run through ``megatron_npu.run_script`` takes the same perturbation
from ``$MEGATRON_NPU_INIT_ULP_NUDGE=K`` (:data:`ENV`, set by compare for a script run's rerun):
Megatron-LM's ``get_model`` then hands ``setup_model_and_optimizer`` the nudged model, before the
optimizer is built from it.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

#: a script run's nudge, in ulps (``megatron_npu.run_script`` reads it)
ENV = "MEGATRON_NPU_INIT_ULP_NUDGE"


def nudge(model_chunks, ulps: int) -> int:
    """Move every floating-point parameter of ``model_chunks`` ``ulps`` representable values;
    return how many parameters were moved."""
    if ulps == 0:
        return 0
    import torch

    moved = 0
    with torch.no_grad():
        for chunk in model_chunks:
            for param in chunk.parameters():
                if not param.is_floating_point():
                    continue
                # on the host: every device's torch has nextafter there (torch_npu need not)
                value = param.detach().cpu()
                target = torch.full_like(value, float("inf") if ulps > 0 else float("-inf"))
                for _ in range(abs(ulps)):
                    value = torch.nextafter(value, target)
                param.copy_(value)
                moved += 1
    return moved


def ulps_from_environment() -> int:
    """:data:`ENV` as an integer (0 when unset); ValueError naming the variable otherwise."""
    raw = os.environ.get(ENV, "").strip()
    try:
        return int(raw or 0)
    except ValueError:
        raise ValueError(f"${ENV} must be a whole number of ulps, got {raw!r}") from None


#: how many models the wrapped ``get_model`` has nudged in this process
nudged_models = 0


def nudge_megatron_lm_models(ulps: int) -> None:
    """Make Megatron-LM's ``get_model`` (``megatron.training.training``, and the package's
    re-export of it) nudge every model it builds by ``ulps``; its caller builds the optimizer
    from the nudged weights, and a checkpoint loaded afterwards (``--load``,
    ``--pretrained-checkpoint``) replaces them (compare refuses those). :data:`nudged_models`
    counts the models it nudged."""
    if ulps == 0:
        return
    package = importlib.import_module("megatron.training")
    training = importlib.import_module("megatron.training.training")
    original = training.get_model

    @functools.wraps(original)
    def get_model(*args: Any, **kwargs: Any) -> Any:
        global nudged_models
        model = original(*args, **kwargs)
        nudge(model if isinstance(model, list) else [model], ulps)
        nudged_models += 1
        return model

    training.get_model = get_model
    if getattr(package, "get_model", None) is original:
        package.get_model = get_model
