"""dist_checkpointing fixes that save/load need off apex/TE (``megatron-npu train``'s and
Megatron-LM's ``pretrain_gpt.py``'s).

* ``filesystem_async._process_memory``: megatron-core's ``torch_dist`` writer process
  (``FileSystemWriterAsync.write_preloaded_data``) starts by calling it, and it raises when
  ``psutil`` is not installed -- which megatron-core does not declare as a dependency. The writer
  process dies before reporting and the saving rank waits on its result queue forever:
  ``dist_checkpointing.save`` hangs. The replacement reads the resident set size from psutil when
  it is installed and from ``/proc`` otherwise (the figure only feeds a debug log line).
* ``DistributedOptimizer._set_main_param_and_optimizer_states``: loading a distributed-optimizer
  checkpoint (``fully_reshardable``, ``fully_sharded_model_space``, ``dp_reshardable``) copies
  every entry of the torch optimizer's per-parameter state from the checkpoint. Without
  apex/TransformerEngine the optimizer is torch's Adam(W),
  whose state also holds ``step``; the loader hands it over separately (through the param
  groups) and leaves it out of the tensors, so the stock copy fails with ``KeyError: 'step'``.
  The wrapper copies the entries the checkpoint provides and leaves ``step`` to that path. A
  ``dp_reshardable`` checkpoint's entries (Megatron-LM's default) also carry, from 0.16, the
  load template's ``step`` (zero: copied, it would restart the bias correction) and their bucket's
  bookkeeping (``padding``, ``gbuf_local_start``, ``gbuf_local_end``), which Megatron's
  precision-aware branch would hand the optimizer as states: both branches get the state
  tensors only, and the precision-aware branch is otherwise Megatron's own.
* ``DistributedOptimizer.get_parameter_state_dp_reshardable`` (megatron-core 0.15): the
  ``dp_reshardable`` checkpoint (Megatron-LM's default format for the distributed optimizer)
  maps every entry of a parameter's state onto its slice of the bucket and asserts each is as
  long as the slice; torch's Adam(W) also keeps a 0-dim ``step`` there, so every save stops at
  that assertion. 0.16 leaves ``step`` out of the bucket (it is saved through the param groups);
  the wrapper does the same on 0.15, for the save and the load template alike, and the load
  takes ``step`` from the param groups as it does on 0.16.
* ``DistributedOptimizer.state_dict``: without apex/TransformerEngine Megatron reads the step
  from every parameter's torch-Adam state, and asserts there is exactly one; a fresh optimizer
  (the one a resumed run loads its checkpoint into, before any step) has no states yet, so the
  load stops at that assertion. The wrapper answers for a fresh optimizer as for one at step 0,
  leaving its states empty (Megatron allocates them for the load only when they are).
* ``DistributedOptimizer.load_state_dict``: that separate path puts *one* ``step`` tensor into
  every parameter's state. Torch's Adam(W) increments each parameter's ``step`` in place
  (``_foreach_add_``), so the shared tensor advances once per parameter per step and the bias
  correction is wrong from the first step after a resume. The wrapper gives each parameter its
  own copy after Megatron's load. Under Megatron-FSDP it first gives the entries of this rank's
  empty shards a step (:func:`.megatron_fsdp.give_empty_shards_a_step`), which torch's Adam
  reads on load.
* ``DistributedOptimizer.sharded_state_dict`` (a save: ``is_loading`` false) and
  ``get_parameter_state_dp_zero`` (the legacy ``--ckpt-format torch`` save): a run whose
  updates were all skipped so far (fp16 while the loss scale backs off from its start) has no
  Adam state yet: Megatron saves a checkpoint without moments, which the resumed run cannot
  load (``exp_avg`` ... not in state dict), and the legacy save stops (``KeyError:
  'exp_avg'``). The wrapper first gives torch Adam(W)'s missing states the zeros of their first
  update (:mod:`megatron_npu.optim.first_update_state`), which is what the next update would
  create.
* megatron-core's common-state loader (from 0.14 it loads the common state with torch's
  ``weights_only`` default): ``--optimizer-cpu-offload``'s ``HybridDeviceOptimizer`` records its
  optimizers' classes in every parameter group, and a format that keeps the groups in the common
  state (the distributed optimizer's ``fully_sharded_model_space``, 0.14's default, and
  ``fully_reshardable``) does not resume without it: torch refuses a class. The wrapper loads
  it with those classes allowed (:mod:`megatron_npu.optim.recorded_classes`), and nothing else.
  The loader is
  ``TorchCommonLoadStrategy.load_common`` up to 0.16, the module function ``load_common`` that
  ``serialization`` calls in 0.17 and 0.18, and ``serialization.load_common_state_dict`` from
  0.19 (which reads the common state from ``common.pt`` or, as 0.19 saves it, from an object
  inside the torch_dist checkpoint).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from megatron_npu.devices import host_memory
from megatron_npu.devices.facts import DEVICES
from megatron_npu.optim.first_update_state import give_missing_state, is_torch_adam
from megatron_npu.optim.recorded_classes import recorded_optimizer_classes
from megatron_npu.patches import megatron_fsdp
from megatron_npu.registry import Patch
from megatron_npu.training.safe_load import also_allowed

_EXEMPT = "checkpoint plumbing, no numerics of its own"
_RESUME_TEST = (
    "tests/megatron_lm/test_pretrain_gpt.py::test_distributed_optimizer_resume_is_bitwise"
)
_FIRST_UPDATE_TEST = (
    "tests/megatron_lm/test_pretrain_gpt.py::test_a_checkpoint_before_the_first_fp16_update_resumes"
)


def _process_memory() -> int:
    """Resident set size of this process in bytes (psutil if installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        return host_memory.rss_bytes()
    return int(psutil.Process(os.getpid()).memory_info().rss)


def _wrap_set_main_param_and_optimizer_states(original: Any) -> Any:
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # the step comes through the param groups; a dp_reshardable bucket entry carries the
        # load template's step (zero, from 0.16) and its bookkeeping beside the states
        states = {
            key: value
            for key, value in tensors.items()
            if key != "step" and hasattr(value, "copy_")
        }
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, states)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        # an fp32 model's main parameter is a view of the model's own (a leaf that needs grad)
        with torch.no_grad():
            for key, value in states.items():
                destination[key].copy_(value)
        return None

    return _set_main_param_and_optimizer_states


def _wrap_dp_reshardable_state(original: Any) -> Any:
    @functools.wraps(original)
    def get_parameter_state_dp_reshardable(self):
        state = original(self)
        for dtype_state in state.values():
            if not isinstance(dtype_state, dict):  # e.g. per_bucket_numel_unpadded
                continue
            for buckets in dtype_state.values():
                for bucket in buckets:
                    for entry in bucket:
                        step = entry.get("step")
                        if isinstance(step, torch.Tensor) and step.dim() == 0:
                            del entry["step"]
        return state

    return get_parameter_state_dp_reshardable


def _wrap_distopt_state_dict(original: Any) -> Any:
    @functools.wraps(original)
    def state_dict(self):
        inner = getattr(self, "optimizer", None)
        params = [p for group in getattr(inner, "param_groups", ()) for p in group["params"]]
        if not params or any(inner.state.get(p) for p in params):
            return original(self)
        for p in params:  # a fresh optimizer: Megatron's torch path reads step 0 from each state
            inner.state[p]["step"] = torch.tensor(0.0)
        try:
            return original(self)
        finally:
            for p in params:
                del inner.state[p]

    return state_dict


def _give_first_update_state(distopt: Any) -> None:
    """The state of their first update for the fp32 main parameters of ``distopt``'s torch
    Adam(W) that have none. The precision-aware optimizer's states, ``--optimizer-cpu-offload``'s
    ``HybridDeviceOptimizer`` (whose states also hold each ``master_param``) and Transformer
    Engine's or apex's fused Adam (other layouts) are left as they are."""
    inner = getattr(distopt, "optimizer", None)
    config = getattr(distopt, "config", None)
    if is_torch_adam(inner) and not getattr(config, "use_precision_aware_optimizer", False):
        give_missing_state(inner)


def _wrap_save_with_first_update_state(original: Any) -> Any:
    """A distributed-optimizer save reader, called after :func:`_give_first_update_state`.
    ``is_loading=True`` (``sharded_state_dict``) and ``empty_data=True``
    (``get_parameter_state_dp_zero``) build a load's template: left as they are."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_reader(*args: Any, **kwargs: Any) -> Any:
        called = signature.bind(*args, **kwargs)
        if not (called.arguments.get("is_loading") or called.arguments.get("empty_data")):
            _give_first_update_state(called.arguments["self"])
        return original(*args, **kwargs)

    return save_reader


def _wrap_load_common_method(original: Any) -> Any:
    @functools.wraps(original)
    def load_common(self, checkpoint_dir):
        with also_allowed(recorded_optimizer_classes()):
            return original(self, checkpoint_dir)

    return load_common


def _wrap_load_common_function(original: Any) -> Any:
    @functools.wraps(original)
    def load_common(checkpoint_dir):
        with also_allowed(recorded_optimizer_classes()):
            return original(checkpoint_dir)

    return load_common


def _wrap_distopt_load_state_dict(original: Any) -> Any:
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if getattr(getattr(self, "ddp_config", None), "use_megatron_fsdp", False):
            megatron_fsdp.give_empty_shards_a_step(state_dict["state"])
        result = original(self, state_dict)
        inner = getattr(self, "optimizer", None)
        seen: set[int] = set()
        for state in getattr(inner, "state", {}).values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is None or not hasattr(step, "clone"):
                continue
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))
        return result

    return load_state_dict


def _wrap_load_parameter_state_from_dp_zero(original: Any) -> Any:
    @functools.wraps(original)
    def load_parameter_state_from_dp_zero(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        hybrid = getattr(args[0], "optimizer", None)
        # update_legacy_format: a pre-2024 file, which no hybrid optimizer wrote; that reader
        # copies the parameters into the groups itself
        if type(hybrid).__name__ == "HybridDeviceOptimizer" and not kwargs.get(
            "update_legacy_format"
        ):
            _restore_hybrid_device_optimizer(hybrid)
        return result

    return load_parameter_state_from_dp_zero


def _restore_hybrid_device_optimizer(hybrid: Any) -> None:
    """After a ``--ckpt-format torch`` parameter-state load into ``hybrid``: its sub-optimizers
    take the loaded states and masters (``_sync_hdo_state_to_sub_optimizers``, which
    megatron-core's ``fully_sharded_model_space`` and ``fully_reshardable`` readers call and
    this one does not), and the model's
    shard takes the loaded master, as the next step's copy-back would write it: the dummy step a
    fresh ``HybridDeviceOptimizer`` takes before the load moved that shard after the model was
    loaded."""
    hybrid._sync_hdo_state_to_sub_optimizers()
    with torch.no_grad():
        for param, state in hybrid.state.items():
            master = state.get("master_param") if isinstance(state, dict) else None
            if master is not None:
                param.copy_(master)


PATCHES = [
    Patch(
        id="checkpoint.writer-process-memory",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async._process_memory",
        replacement=_process_memory,
        reason="stock version raises without psutil inside the torch_dist writer: save hangs",
        versions=">=0.13",
        devices=DEVICES,
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test="tests/patches/test_exempt_plumbing.py::test_writer_process_memory_without_psutil",
    ),
    Patch(
        id="checkpoint.distopt-dp-reshardable-step",
        target="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
        "get_parameter_state_dp_reshardable",
        replacement=_wrap_dp_reshardable_state,
        kind="wrap",
        reason="torch Adam's 0-dim 'step' in a dp_reshardable bucket entry fails Megatron's "
        "slice-length assertion: every save stops (0.16 leaves it out)",
        versions=">=0.15,<0.16",
        devices=DEVICES,
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_RESUME_TEST,
    ),
    Patch(
        id="checkpoint.distopt-load-torch-adam-step",
        target="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
        "_set_main_param_and_optimizer_states",
        replacement=_wrap_set_main_param_and_optimizer_states,
        kind="wrap",
        reason="a distributed-optimizer load copies every torch-Adam state key; 'step' comes "
        "apart, and dp_reshardable entries carry a zero step and bucket bookkeeping",
        versions=">=0.13",
        devices=DEVICES,
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_RESUME_TEST,
    ),
    Patch(
        id="checkpoint.distopt-fresh-optimizer-step",
        target="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
        replacement=_wrap_distopt_state_dict,
        kind="wrap",
        reason="a fresh torch-Adam optimizer has no per-parameter step: loading a checkpoint "
        "into it stops at Megatron's one-step assertion",
        versions=">=0.13",
        devices=DEVICES,
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_RESUME_TEST,
    ),
    Patch(
        id="checkpoint.distopt-load-unshare-step",
        target="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
        replacement=_wrap_distopt_load_state_dict,
        kind="wrap",
        reason="one 'step' tensor shared by all params: torch Adam advances it N times a step",
        versions=">=0.13",
        devices=DEVICES,
        parity_exempt=_EXEMPT,
        benchmark_exempt=_EXEMPT,
        exempt_test=_RESUME_TEST,
    ),
    *(
        Patch(
            id=f"checkpoint.first-update-state{suffix}",
            target=f"megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.{method}",
            replacement=_wrap_save_with_first_update_state,
            kind="wrap",
            reason="a save before any applied update (fp16 while the loss scale backs off) "
            f"{what}: the missing Adam states are given their first update's zeros",
            versions=">=0.13",
            devices=DEVICES,
            parity_exempt=_EXEMPT,
            benchmark_exempt="runs once per checkpoint save",
            exempt_test=_FIRST_UPDATE_TEST,
        )
        for suffix, method, what in (
            (
                "",
                "sharded_state_dict",
                "writes no moments, so the resume cannot load it",
            ),
            (
                "-legacy",
                "get_parameter_state_dp_zero",
                "of --ckpt-format torch stops at the missing moments",
            ),
        )
    ),
    Patch(
        id="checkpoint.offload-legacy-load-model-shard",
        target="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
        "load_parameter_state_from_dp_zero",
        replacement=_wrap_load_parameter_state_from_dp_zero,
        kind="wrap",
        reason="--optimizer-cpu-offload: the dummy step before a --ckpt-format torch load "
        "moves the loaded model shard, and the restored master does not reach it: a resumed "
        "run departs from the saved one",
        versions=">=0.13",
        devices=DEVICES,
        parity_exempt=_EXEMPT,
        benchmark_exempt="runs once per checkpoint load",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::"
        "test_legacy_checkpoint_of_an_offloaded_optimizer_resumes_bitwise",
    ),
    *(
        Patch(
            id=f"checkpoint.common-state-optimizer-classes{suffix}",
            target=target,
            replacement=replacement,
            kind="wrap",
            reason="--optimizer-cpu-offload records its optimizers' classes in the common "
            "state, which torch's weights_only load refuses: such checkpoints do not resume",
            versions=versions,  # 0.13 loads common.pt with weights_only=False
            devices=DEVICES,
            parity_exempt=_EXEMPT,
            benchmark_exempt="runs once per checkpoint load",
            exempt_test="tests/patches/test_exempt_plumbing.py::"
            "test_common_state_with_offload_optimizer_classes_loads",
        )
        for suffix, target, replacement, versions in (
            (
                "",
                "megatron.core.dist_checkpointing.strategies.common.TorchCommonLoadStrategy."
                "load_common",
                _wrap_load_common_method,
                ">=0.14,<0.17",
            ),
            (
                "-in-load-common",
                "megatron.core.dist_checkpointing.serialization.load_common",
                _wrap_load_common_function,
                ">=0.17,<0.19",
            ),
            (
                "-in-load-common-state-dict",
                "megatron.core.dist_checkpointing.serialization.load_common_state_dict",
                _wrap_load_common_function,
                ">=0.19",
            ),
        )
    ),
]
