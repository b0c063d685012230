"""The LR / weight-decay schedule a command line asks for, as Megatron's
``OptimizerParamScheduler`` keeps it (and checks it against a checkpoint on resume).

Pure Python, so the launcher can compare it with a checkpoint's before any rank starts. Lengths
count samples (Megatron-LM's iteration-based set-up): ``iters x global batch size``.
"""

from __future__ import annotations

from argparse import Namespace

#: Each schedule field and the flags that set it (named when a resume finds it changed).
FIELD_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters x --global-batch-size",
    "lr_decay_steps": "--lr-decay-iters (default --train-iters) x --global-batch-size",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "--train-iters x --global-batch-size",
    "wd_incr_style": "(fixed: constant)",
}


def scheduler_settings(args: Namespace) -> dict:
    """``OptimizerParamScheduler`` keyword arguments (its state-dict names) for ``args``."""
    samples = args.global_batch_size
    return {
        "max_lr": float(args.lr),
        "min_lr": float(args.min_lr),
        "lr_warmup_steps": args.lr_warmup_iters * samples,
        "lr_decay_steps": args.lr_decay_iters * samples,
        "lr_decay_style": args.lr_decay_style,
        "start_wd": float(args.weight_decay),
        "end_wd": float(args.weight_decay),
        "wd_incr_steps": args.train_iters * samples,
        "wd_incr_style": "constant",
    }
