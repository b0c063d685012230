"""Checkpoints through ``megatron.core.dist_checkpointing`` (``torch_dist``), reshardable.

Layout on disk (Megatron-LM's):

    SAVE/latest_checkpointed_iteration.txt      "5"
    SAVE/iter_0000005/                          dist_checkpointing's torch_dist files

What one checkpoint holds:

* ``model`` (or ``model0``, ``model1``, ... with virtual stages): each ``GPTModel``'s
  ``sharded_state_dict()`` -- keys carry *global* layer numbers and TP slices, so a checkpoint
  loads into any other TP/PP/VPP/DP layout;
* ``optimizer``: the optimizer's ``sharded_state_dict`` built on those model tensors (Adam moments
  and fp32 master weights follow the parameters they belong to); the distributed optimizer uses
  the ``fully_reshardable`` format so it, too, loads into another layout;
* ``opt_param_scheduler``, ``iteration``, ``consumed_train_samples``, the saving ``layout``;
* ``rng_state``: a ``ShardedObject`` per (PP, TP) rank -- python, numpy, torch and device RNG
  states and the model-parallel RNG tracker. Like Megatron-LM, a run that resumes with another
  (TP, PP) layout ignores the saved RNG state (it has no meaning there) and says so.

After a save, directories are set to 0750 and files to 0640 (:mod:`.security`).
"""

from __future__ import annotations

import logging
import os
import random
from argparse import Namespace
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_npu import devices
from megatron_npu.training import security
from megatron_npu.training.arguments import ArgumentError
from megatron_npu.training.model import unwrap

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


@dataclass
class Resume:
    iteration: int = 0
    consumed_samples: int = 0
    loaded_from: str | None = None
    rng_restored: bool = False


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _layout(args: Namespace) -> dict[str, int]:
    return {
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size or 1,
    }


def _metadata(args: Namespace) -> dict:
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    return metadata


def _rng_state() -> dict:
    device = devices.require_active()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "device_rng_state": device.accelerator.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    device = devices.require_active()
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device.accelerator.set_rng_state(state["device_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(data: list | None) -> ShardedObject:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject(
        "rng_state",
        data,
        (pp_size, tp_size),
        (pp_rank, tp_rank),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _state_dict(
    args: Namespace,
    model: list[torch.nn.Module],
    optimizer,
    scheduler,
    iteration: int,
    *,
    loading: bool,
    with_optimizer: bool,
    with_rng: bool,
) -> dict:
    metadata = _metadata(args)
    state: dict = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": iteration * args.global_batch_size,
        "layout": _layout(args),
        "saved_rng": with_rng,
        "use_distributed_optimizer": bool(args.use_distributed_optimizer),
    }
    for index, chunk in enumerate(model):
        state[_model_key(index, len(model))] = unwrap(chunk).sharded_state_dict(metadata=metadata)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=loading, metadata=metadata
        )
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object([_rng_state()])
    return state


def save(args: Namespace, model, optimizer, scheduler, iteration: int) -> str:
    """Save iteration ``iteration`` under ``args.save`` (collective)."""
    root = args.save
    path = iteration_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if rank == 0:
        security.make_dir(path)
    torch.distributed.barrier()
    sync_params(model)
    state = _state_dict(
        args, model, optimizer, scheduler, iteration,
        loading=False, with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng,
    )  # fmt: skip
    dist_checkpointing.save(state, path, sharded_strategy=("torch_dist", 1))
    torch.distributed.barrier()
    if rank == 0:
        security.write_private(os.path.join(root, TRACKER), f"{iteration}\n")
        security.harden_tree(root)
    torch.distributed.barrier()
    return path


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer's torch Adam its state before loading into it.

    ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` first calls its own
    ``state_dict()``, which (without apex/TransformerEngine) reads every parameter's ``step``
    from the torch optimizer's state -- empty before the first step, so megatron-core 0.16.1
    fails an assertion. Zero ``step``/``exp_avg``/``exp_avg_sq`` (what Adam starts from) are put
    in place; the load then overwrites them with the checkpoint's values.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or inner is None or inner.state:
            continue
        if getattr(opt.config, "optimizer", None) != "adam":  # torch Adam(W)'s state layout
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param.data),
                    "exp_avg_sq": torch.zeros_like(param.data),
                }


def sync_params(model) -> None:
    """With ``--overlap-param-gather`` the distributed optimizer's updated parameters are
    all-gathered lazily (DDP forward pre-hooks); finish that now (what Megatron-LM's
    ``disable_forward_pre_hook`` does before a save)."""
    for chunk in model:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8").read().strip()
    return int(text)


def load(args: Namespace, model, optimizer, scheduler) -> Resume:
    """Load the latest checkpoint under ``args.load`` into this layout (collective)."""
    root = args.load
    iteration = latest_iteration(root) if root else None
    if args.ckpt_step is not None:
        iteration = args.ckpt_step
        if not os.path.isdir(iteration_dir(root, iteration)):
            raise ArgumentError(f"--ckpt-step {iteration}: no {iteration_dir(root, iteration)}")
    if iteration is None:
        if root and torch.distributed.get_rank() == 0:
            print(f" no checkpoint under {root}: starting from scratch", flush=True)
        return Resume()
    path = iteration_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    saved_layout = common.get("layout", {})
    here = _layout(args)
    same_tp_pp = all(
        saved_layout.get(k) == here[k]
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    )
    has_rng = not args.no_load_rng and same_tp_pp and bool(common.get("saved_rng"))
    has_optim = not args.no_load_optim and "opt_param_scheduler" in common
    saved_distopt = bool(common.get("use_distributed_optimizer", False))
    if has_optim and saved_distopt != bool(args.use_distributed_optimizer):
        kind = "with" if saved_distopt else "without"
        raise ArgumentError(
            f"{path} was saved {kind} --use-distributed-optimizer: megatron-core cannot load "
            "that optimizer state into the other optimizer kind; match the flag, or pass "
            "--no-load-optim to take the model weights (and iteration) only"
        )
    if has_optim:
        _materialize_optimizer_state(optimizer)
    state = _state_dict(
        args, model, optimizer, scheduler, iteration,
        loading=True, with_optimizer=has_optim, with_rng=has_rng,
    )  # fmt: skip
    loaded = dist_checkpointing.load(state, path, sharded_strategy=None)
    for index, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[_model_key(index, len(model))], strict=True)
    if has_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if has_rng:
        _set_rng_state(loaded["rng_state"][0])
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        note = "" if has_rng else (
            " (RNG state not restored: saved with another (TP, PP) layout)"
            if not same_tp_pp and not args.no_load_rng
            else ""
        )
        print(
            f" loaded checkpoint {path} at iteration {iteration} "
            f"(saved layout {saved_layout}, this run {here}){note}",
            flush=True,
        )
    torch.distributed.barrier()
    return Resume(
        iteration=iteration,
        consumed_samples=int(common.get("consumed_train_samples", 0)),
        loaded_from=path,
        rng_restored=has_rng,
    )
