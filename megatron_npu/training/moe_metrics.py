"""The MoE auxiliary losses of a step, as Megatron-LM reports them.

megatron-core's routers record each MoE layer's auxiliary losses (``load_balancing_loss``,
``z_loss``, ...) into its tracker, summed over the micro-batches of the step. Megatron-LM's
``training_log`` reduces them across ranks (pipeline stages hold different layers), averages
over the MoE layers and scales by 1 / micro-batches; this does the same through megatron-core's
own tracker functions and clears the tracker for the next step. Every rank must call it (the
reduction is collective); each gets the same figures.
"""

from __future__ import annotations

import warnings


def step_aux_losses(num_microbatches: int, num_moe_layers: int) -> dict[str, float]:
    """``{name: value}`` of this step's auxiliary losses (empty when no MoE layer recorded)."""
    from megatron.core.transformer.moe import moe_utils

    with warnings.catch_warnings():  # the legacy-format helpers are deprecated from 0.16 on
        warnings.simplefilter("ignore", DeprecationWarning)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if not tracker:
            return {}
        moe_utils.reduce_aux_losses_tracker_across_ranks()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        losses = {
            name: float(entry["values"].float().sum()) / num_moe_layers / num_microbatches
            for name, entry in tracker.items()
        }
        moe_utils.clear_aux_losses_tracker()
    return losses
