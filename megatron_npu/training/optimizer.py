"""Megatron's optimizer and learning-rate / weight-decay scheduler, configured as Megatron-LM does.

``get_megatron_optimizer`` picks the wrapper from the config: ``FP32Optimizer`` (fp32),
``Float16OptimizerWithFloat16Params`` (fp16 with a dynamic or constant grad scaler, bf16 without
one) or ``DistributedOptimizer`` (``--use-distributed-optimizer``). Without apex or
TransformerEngine the inner optimizer is ``torch.optim.AdamW`` (or SGD); fused NPU versions come
in through registry patches. Biases and 1-D parameters get no weight decay (Megatron-Core's
default parameter groups).

The scheduler counts *samples*, as Megatron-LM's iteration-based set-up does: warm-up and decay
lengths are ``iters x global batch size`` and every successful step advances it by one global
batch; skipped (overflow) steps do not advance it.
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_npu.training.arguments import CPU_OFFLOAD_OPTIONS, PRECISION_AWARE_DTYPES
from megatron_npu.training.model import params_dtype
from megatron_npu.training.schedule import scheduler_settings

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def optimizer_config(args: Namespace) -> OptimizerConfig:
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    # megatron-core 0.13 reads overlap_param_gather from the DDP config only
    newer = fields & {"overlap_param_gather"}
    # Megatron-LM's --fp8-recipe default: megatron-core 0.13's factory hands the precision-aware
    # optimizer its master weights (and the decoupled grads it is given) only with it
    recipe = {"fp8_recipe": "delayed"} if "fp8_recipe" in fields else {}
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        use_distributed_optimizer=args.use_distributed_optimizer,
        **{name: getattr(args, name) for name in newer},
        clip_grad=args.clip_grad,
        log_num_zeros_in_grad=False,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        **{name: _DTYPES[getattr(args, name)] for name in PRECISION_AWARE_DTYPES},
        **{name: getattr(args, name) for name in CPU_OFFLOAD_OPTIONS},
        **recipe,
    )


def build(args: Namespace, model: list[torch.nn.Module]):
    """``(optimizer, scheduler)`` for the DDP-wrapped model chunks."""
    optimizer = get_megatron_optimizer(optimizer_config(args), model)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "init_state_fn", False) is None and args.optimizer == "sgd":
            opt.init_state_fn = sgd_init_state
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        **scheduler_settings(args),
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
    return optimizer, scheduler


def sgd_init_state(opt: torch.optim.Optimizer, config=None) -> None:
    """Zero momentum buffers for a fresh SGD, what a checkpoint's momentum loads into.

    megatron-core gives Adam an ``init_state_fn`` but SGD none (``None``), and its optimizers
    call it unconditionally when building the loading state dict: without this, an SGD run
    cannot resume (``TypeError: 'NoneType' object is not callable``)."""
    for group in opt.param_groups:
        if not group.get("momentum", 0):
            continue
        for param in group["params"]:
            if len(opt.state[param]) == 0:
                opt.state[param]["momentum_buffer"] = torch.zeros_like(param.data)


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
