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
  the ``fully_reshardable`` format (``fully_sharded_model_space`` up to megatron-core 0.14) so
  it, too, loads into another layout;
* ``opt_param_scheduler``, ``iteration``, ``consumed_train_samples``, the saving ``layout``;
* ``rng_state``: a ``ShardedObject`` per (PP, TP) rank -- python, numpy, torch and device RNG
  states and the model-parallel RNG tracker. Like Megatron-LM, a run that resumes with another
  (TP, PP) layout ignores the saved RNG state (it has no meaning there) and says so.

Crash safety and verification (:mod:`.checkpoint_store`): every rank writes into
``iter_N.partial``; rank 0 then records each file's SHA-256, the model fingerprint and the LR
schedule in a manifest, renames the directory to ``iter_N`` and only then moves the tracker. A
failed or killed save leaves the previous checkpoint and the tracker as they were; a full disk or
a read-only directory is reported as a :class:`~.errors.TrainingInputError` naming ``--save``.
Loads run with :mod:`.safe_load` unless ``--no-safe-load``.

After a save, directories are set to 0750 and files to 0640 (:mod:`.security`).

Test-only fault injection (``tests/faults``): ``$MEGATRON_NPU_TEST_FAULT`` =
``save-enospc:N`` makes rank 0 fail iteration ``N``'s save with ``ENOSPC`` after the data is
written, ``save-sigkill:N:R`` makes rank ``R`` kill itself (SIGKILL) at the same point. Never
set it in a real run.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
from argparse import Namespace
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from megatron_npu import console, devices
from megatron_npu.optim.first_update_state import give_missing_state, is_torch_adam
from megatron_npu.training import checkpoint_store as store
from megatron_npu.training import safe_load, security
from megatron_npu.training.errors import TrainingInputError
from megatron_npu.training.model import unwrap
from megatron_npu.training.schedule import FIELD_FLAGS

logger = logging.getLogger(__name__)

TRACKER = store.TRACKER
CHECKPOINT_VERSION = 3.0
FAULT_ENV = "MEGATRON_NPU_TEST_FAULT"


@dataclass
class Resume:
    iteration: int = 0
    consumed_samples: int = 0
    loaded_from: str | None = None
    rng_restored: bool = False


iteration_dir = store.iteration_dir


def _layout(args: Namespace) -> dict[str, int]:
    return {
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size or 1,
    }


def _metadata(args: Namespace) -> dict:
    from megatron_npu.patcher import megatron_core_below

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        # the format that loads into another layout: megatron-core 0.15 names it
        # fully_reshardable; up to 0.14 it is fully_sharded_model_space (which 0.15+ still loads)
        metadata["distrib_optim_sharding_type"] = (
            "fully_sharded_model_space" if megatron_core_below("0.15") else "fully_reshardable"
        )
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


def _injected_fault(kind: str, iteration: int) -> list[str] | None:
    """The test-only fault of ``kind`` for ``iteration`` ($MEGATRON_NPU_TEST_FAULT), if set."""
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if spec[0] == kind and len(spec) > 1 and spec[1] == str(iteration):
        return spec[2:]
    return None


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (torch/Megatron wrap the writers' errors), if any."""
    seen, todo = set(), [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        todo += [current.__cause__, current.__context__]
        todo += [a for a in getattr(current, "args", ()) if isinstance(a, BaseException)]
        todo += list(getattr(current, "failures", {}).values())
    return None


def _save_error(root: str, iteration: int, error: OSError) -> TrainingInputError:
    kept = store.read_tracker(root) if os.path.isdir(root) else None
    kept_note = (
        f"the previous checkpoint (iteration {kept}) is intact and the tracker still names it"
        if kept is not None
        else "no earlier checkpoint exists there"
    )
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        problem = f"--save {root}: no space left on the device while saving iteration {iteration}"
        remedy = f"free space or point --save elsewhere; {kept_note}"
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        problem = f"--save {root} is not writable ({error.strerror}) at iteration {iteration}"
        remedy = f"give a writable directory; {kept_note}"
    else:
        problem = f"--save {root}: saving iteration {iteration} failed ({error.strerror})"
        remedy = kept_note
    return TrainingInputError(problem, remedy)


def _manifest_fields(args: Namespace, scheduler, with_optimizer: bool) -> dict:
    return {
        "fingerprint": store.fingerprint(args, args.tokenizer_vocab_size),
        "scheduler": {f: getattr(scheduler, f) for f in FIELD_FLAGS} if with_optimizer else None,
        "arguments": {
            "train_iters": args.train_iters,
            "global_batch_size": args.global_batch_size,
            "use_distributed_optimizer": bool(args.use_distributed_optimizer),
        },
        "layout": _layout(args),
    }


def _enospc_fault(_work: str) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(test fault)")


def save(args: Namespace, model, optimizer, scheduler, iteration: int) -> str:
    """Save iteration ``iteration`` under ``args.save`` (collective; crash-safe, see above)."""
    root = args.save
    rank = torch.distributed.get_rank()
    with_optimizer = not args.no_save_optim
    try:
        if rank == 0:
            store.begin(root, iteration)
        torch.distributed.barrier()
        sync_params(model)
        if with_optimizer:
            _materialize_optimizer_state(optimizer)
        state = _state_dict(
            args,
            model,
            optimizer,
            scheduler,
            iteration,
            loading=False,
            with_optimizer=with_optimizer,
            with_rng=not args.no_save_rng,
        )
        dist_checkpointing.save(
            state, store.partial_dir(root, iteration), sharded_strategy=("torch_dist", 1)
        )
        kill = _injected_fault("save-sigkill", iteration)
        if kill is not None and int(kill[0]) == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.barrier()
        path = store.iteration_dir(root, iteration)
        if rank == 0:
            fault = _enospc_fault if _injected_fault("save-enospc", iteration) is not None else None
            path = store.commit(
                root, iteration, _manifest_fields(args, scheduler, with_optimizer), fault=fault
            )
            security.harden_tree(root)
    except Exception as exc:
        error = _os_error(exc)
        if error is None:
            raise
        raise _save_error(root, iteration, error) from None
    torch.distributed.barrier()
    return path


def _materialize_optimizer_state(optimizer) -> None:
    """Give every parameter of the torch Adam(W) inside ``optimizer`` the state it starts from
    (zero ``step``, ``exp_avg`` and ``exp_avg_sq``: what Adam creates at its first update) where
    it has none yet.

    * Before loading into a fresh optimizer: a distributed one's
      ``sharded_state_dict(is_loading=True)`` first calls its own ``state_dict()``, which
      (without apex/TransformerEngine) reads every parameter's ``step`` -- empty before the first
      step, so megatron-core 0.16.1 fails an assertion; Megatron's own ``init_state_fn`` of the
      others creates the moments without ``step`` (KeyError 'step' on load). The load
      overwrites the zeros.
    * Before every save: a run whose updates were all skipped (fp16 overflows at the first loss
      scales) has no Adam state yet, and a checkpoint saved without it cannot be loaded (the
      loading optimizer asks for ``exp_avg``). The zeros are exactly the state the next update
      would create, so the saved run and its resume stay the same.

    (SGD's momentum buffers come from :func:`megatron_npu.training.optimizer.sgd_init_state`.)
    ``--optimizer-cpu-offload``'s ``HybridDeviceOptimizer`` is not a torch Adam(W) and is left
    as it is: its states also hold each fp32 copy as ``master_param``, and Megatron's
    distributed optimizer gives a fresh one a dummy step before loading into it, which it skips
    once any state exists.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if is_torch_adam(inner):
            give_missing_state(inner)


def _restore_zero_steps(optimizer_state) -> None:
    """Put back the Adam ``step`` megatron-core leaves out of a checkpoint when it is zero.

    megatron-core saves Adam's per-parameter ``step`` once, as ``common_step``, and only when
    it is truthy: a run whose updates were all skipped (fp16 overflows) saves its zero-step
    moments without any ``step``, and torch's ``Adam.load_state_dict`` then fails with
    ``KeyError: 'step'``. A per-parameter state with moments and no ``step`` is such a state:
    its step is 0.
    """
    todo = [optimizer_state]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            states = node.get("state")
            if isinstance(states, dict):
                for param_state in states.values():
                    if isinstance(param_state, dict) and "exp_avg" in param_state:
                        param_state.setdefault("step", torch.zeros((), dtype=torch.float32))
            todo.extend(node.values())
        elif isinstance(node, list | tuple):
            todo.extend(node)


def sync_params(model) -> None:
    """With ``--overlap-param-gather`` the distributed optimizer's updated parameters are
    all-gathered lazily (DDP forward pre-hooks); finish that now (what Megatron-LM's
    ``disable_forward_pre_hook`` does before a save)."""
    for chunk in model:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def latest_iteration(root: str) -> int | None:
    return store.read_tracker(root)


def _load_failed(path: str, root: str, iteration, exc: BaseException) -> TrainingInputError:
    exc = safe_load.first_rank_failure(exc)
    first = safe_load.refusal_detail(exc)  # one whole line, never cut mid-sentence
    return TrainingInputError(
        f"checkpoint {path} could not be loaded ({exc.__class__.__name__}: {first})",
        store.remedy_other_iteration(root, iteration),
    )


def _load_scheduler(scheduler, state: dict, path: str) -> None:
    try:
        scheduler.load_state_dict(state)
    except AssertionError as exc:  # Megatron's _check_and_set: saved schedule != command line
        raise TrainingInputError(
            f"checkpoint {path} was saved with another LR/WD schedule ({exc})",
            "pass --override-opt_param-scheduler to use this command line's schedule, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's",
        ) from None


def load(args: Namespace, model, optimizer, scheduler) -> Resume:
    """Load the latest checkpoint under ``args.load`` into this layout (collective).

    The launcher has verified it (:mod:`.preflight`); what can still fail here is reported as a
    :class:`~.errors.TrainingInputError` naming the checkpoint."""
    root = args.load
    iteration = args.ckpt_step if args.ckpt_step is not None else latest_iteration(root)
    if iteration is None or not os.path.isdir(iteration_dir(root, iteration)):
        if not args.load_optional or args.ckpt_step is not None:
            raise TrainingInputError(
                f"--load {root}: no checkpoint "
                f"{iteration_dir(root, iteration) if iteration is not None else 'tracker'}",
                "pass --load-optional to start from scratch instead",
            )
        if torch.distributed.get_rank() == 0:
            console.say(f" no checkpoint under {root}: starting from scratch (--load-optional)")
        return Resume()
    path = iteration_dir(root, iteration)
    try:
        return _load(args, model, optimizer, scheduler, root, iteration, path)
    except TrainingInputError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if is_peer_failure(exc):
            raise
        raise _load_failed(path, root, iteration, exc) from None


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank went away (not this checkpoint's fault)."""
    text = str(exc)
    return isinstance(exc, torch.distributed.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )


def _safe(args):
    """Object shards restricted while a checkpoint loads (from megatron-core 0.19 the common state
    is one of them), unless --no-safe-load."""
    return safe_load.restricted_objects() if args.safe_load else contextlib.nullcontext()


def _load(args, model, optimizer, scheduler, root, iteration, path) -> Resume:
    with _safe(args):
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
    if has_optim:
        store.check_optimizer_kind(path, saved_distopt, args)
    if has_optim:  # every optimizer: a fresh one has no state for the checkpoint's to land in
        _materialize_optimizer_state(optimizer)
    state = _state_dict(
        args,
        model,
        optimizer,
        scheduler,
        iteration,
        loading=True,
        with_optimizer=has_optim,
        with_rng=has_rng,
    )
    with _safe(args):
        loaded = dist_checkpointing.load(state, path, sharded_strategy=None)
    for index, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[_model_key(index, len(model))], strict=True)
    if has_optim:
        _restore_zero_steps(loaded["optimizer"])
        optimizer.load_state_dict(loaded["optimizer"])
        _load_scheduler(scheduler, loaded["opt_param_scheduler"], path)
    else:
        optimizer.reload_model_params()
    if has_rng:
        _set_rng_state(loaded["rng_state"][0])
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        note = (
            ""
            if has_rng
            else (
                " (RNG state not restored: saved with another (TP, PP) layout)"
                if not same_tp_pp and not args.no_load_rng
                else ""
            )
        )
        console.say(
            f" loaded checkpoint {path} at iteration {iteration} "
            f"(saved layout {saved_layout}, this run {here}){note}"
        )
    torch.distributed.barrier()
    return Resume(
        iteration=iteration,
        consumed_samples=int(common.get("consumed_train_samples", 0)),
        loaded_from=path,
        rng_restored=has_rng,
    )
