"""``--init-ulp-nudge K``: every initial weight moved K ulps of its own dtype, before training.

A rounding-level perturbation: the same model, data and arithmetic, every weight at the next
representable value (``torch.nextafter``, up for K > 0, down for K < 0). How far a run's curve
moves from its unperturbed twin measures what the configuration amplifies rounding into;
``compare``'s noise rule (:mod:`megatron_npu.compare.noise`) turns two such reruns into the band
a candidate on another device is judged against. It runs after the model is built and before the
optimizer copies the weights (its fp32 main copy of 16-bit weights starts from the nudged ones).
"""

from __future__ import annotations

import torch


def nudge(model_chunks, ulps: int) -> int:
    """Move every floating-point parameter of ``model_chunks`` ``ulps`` representable values;
    return how many parameters were moved."""
    if ulps == 0:
        return 0
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
