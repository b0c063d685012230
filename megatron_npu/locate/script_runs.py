"""Locate's runs of a user's own Megatron-LM script (``pretrain_gpt.py`` or any script built on
``megatron.training.pretrain``), through the adaptor as :mod:`megatron_npu.run_script` runs it.

A run is the script with the user's arguments plus what the step asks for:

* a **curve run** trains as the arguments say, writes each step's loss and gradient norm (the
  values ``train_step`` returns, which Megatron-LM then logs) and dumps step 1 on the way;
* the **reference replay** of step ``s > 1`` is two runs: the script stops after step ``s - 1``
  and saves there (Megatron-LM's own ``--save``/``--exit-interval``), then it loads that
  checkpoint (``--load``: weights, optimizer, RNG and the data position) and dumps step ``s``;
* a **candidate replay** (and each culprit trial) loads the same checkpoint and dumps step ``s``
  with the patches under trial switched off through ``$MEGATRON_NPU_DISABLE``, the per-patch
  switch every script run reads, and the kernels under trial served natively through
  ``$MEGATRON_NPU_NATIVE_KERNELS`` (:mod:`megatron_npu.ops.kernels`).

The dump is the one :class:`~.dump.Recorder` writes for ``megatron-npu train``'s replays: module
hooks on the unwrapped model chunks, the patches each module reaches (:class:`~.trace.Tracer`,
tracing the model's and the optimizer's build and the step), the parameters' gradients and
updates. It is taken by wrapping Megatron-LM's ``setup_model_and_optimizer``,
``get_megatron_optimizer`` and ``train_step`` in ``megatron.training.training`` (each called by
its module-global name there, on every supported release); the script itself is unchanged.

The ranks start warm (:func:`megatron_npu.training.launch.run_warm`, torchrun's environment);
the device and the switched-off patches are set in each rank before the adaptor is applied, so
the fork server is shared by both runs and every trial.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from megatron_npu.formats.locate_curve import LocateCurve
from megatron_npu.locate.options import take

#: the side options locate reads itself; the rest are the script's own arguments
LAUNCH_WITH_VALUE = ("--device", "--nproc-per-node", "--disable-patch")
#: the script's options that locate sets for each replay (a replay saves, loads and stops where
#: the search needs it, and a checkpoint holds the whole state)
_DROPPED_WITH_VALUE = (
    "--save",
    "--load",
    "--save-interval",
    "--exit-interval",
    "--exit-duration-in-mins",
    "--ckpt-step",
)
_DROPPED_FLAGS = (
    "--no-save-optim",
    "--no-save-rng",
    "--no-load-optim",
    "--no-load-rng",
    "--finetune",
)


def split_options(argv: list[str]) -> tuple[list[str], str | None, int, list[str]]:
    """(the script's own arguments, device, ranks, disabled patches) from one side's options,
    the options a replay sets itself left out."""
    out, taken = take(argv, (*LAUNCH_WITH_VALUE, *_DROPPED_WITH_VALUE), _DROPPED_FLAGS)
    device = taken.get("--device", [None])[-1]
    world = int(taken.get("--nproc-per-node", ["1"])[-1])
    return out, device, world, taken.get("--disable-patch", [])


def replay_arguments(spec: dict[str, Any]) -> list[list[str]]:
    """The script arguments of the runs one locate spec (``stop``, ``load``, ``save_before``,
    ``hook_step``) takes, in order; the hooks run in the last."""
    base = list(spec["script_args"])
    runs = []
    save = spec.get("save_before")
    if save:  # the reference's state just before the replayed step, in Megatron-LM's format
        before = str(int(spec["hook_step"]) - 1)
        runs.append([*base, "--save", save, "--save-interval", before, "--exit-interval", before])
        base = [*base, "--load", save]
    elif spec.get("load"):
        base = [*base, "--load", spec["load"]]
    if spec.get("curve") is None:  # a replay ends with the step it dumps
        base = [*base, "--exit-interval", str(int(spec["stop"]))]
    runs.append(base)
    return runs


def _scalar(value: Any) -> float | None:
    """A ``loss_dict`` value as Megatron-LM logs it: a tensor, or a (sum, count) pair."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().double().cpu().reshape(-1)
        return float(value[0] / value[1]) if value.numel() == 2 else float(value.mean())
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return float(value[0]) / float(value[1])
    return float(value)


def _loss(loss_dict: dict[str, Any]) -> float | None:
    if not loss_dict:
        return None
    key = "lm loss" if "lm loss" in loss_dict else next(iter(loss_dict))
    return _scalar(loss_dict[key])


@contextlib.contextmanager
def _hooks(spec: dict[str, Any]):
    """Wrap Megatron-LM's training functions for the curve and the dump (module docstring)."""
    import torch
    from megatron.training import training
    from megatron.training.global_vars import get_args
    from megatron.training.utils import unwrap_model

    from megatron_npu import devices, patcher
    from megatron_npu.locate.dump import DEFAULT_LIMIT, OPTIMIZER, Recorder, write_meta
    from megatron_npu.locate.trace import Tracer
    from megatron_npu.locate.worker import _coords
    from megatron_npu.ops.kernels import served_natively

    hook_step = spec.get("hook_step")
    tracer = Tracer() if hook_step else None
    curve = LocateCurve.empty()
    originals = {
        name: getattr(training, name) for name in ("setup_model_and_optimizer", "train_step")
    }

    def setup_model_and_optimizer(*args, **kwargs):
        with tracer.active(building=True) if tracer else contextlib.nullcontext():
            return originals["setup_model_and_optimizer"](*args, **kwargs)

    def train_step(*args, **kwargs):
        margs = get_args()
        step = int(margs.curr_iteration) + 1
        if step != hook_step:
            result = originals["train_step"](*args, **kwargs)
            loss, grad_norm = _loss(result[0]), _scalar(result[5])
        else:
            model = kwargs["model"] if "model" in kwargs else args[2]
            optimizer = kwargs["optimizer"] if "optimizer" in kwargs else args[3]
            chunks = unwrap_model(list(model))
            recorder = Recorder(
                chunks, tracer, int(spec.get("limit", DEFAULT_LIMIT)), int(margs.num_layers)
            )
            with tracer.attributed(optimizer, "step", OPTIMIZER):
                with recorder, tracer.active():
                    result = originals["train_step"](*args, **kwargs)
            loss, grad_norm = _loss(result[0]), _scalar(result[5])
            recorder.record_parameters()
            rank = torch.distributed.get_rank()
            recorder.write(spec["dump"], rank, _coords())
            last = rank == torch.distributed.get_world_size() - 1  # the last pipeline stage
            if last:
                device = devices.require_active()
                write_meta(
                    spec["dump"],
                    step=step,
                    world=torch.distributed.get_world_size(),
                    device=device.name,
                    dtype=str(margs.params_dtype).removeprefix("torch."),
                    script=spec["script"],
                    argv=list(spec["script_args"]),
                    disabled=list(spec.get("disable", ())),
                    plant=None,
                    npu_kernels=device.kernels is not None,
                    native_kernels=sorted(served_natively()),
                    loss=loss,
                    grad_norm=grad_norm,
                    applied=[r.id for r in patcher.results() if r.status == patcher.APPLIED],
                )
        curve.add(step, loss, grad_norm)
        return result

    local = {"setup_model_and_optimizer": setup_model_and_optimizer, "train_step": train_step}
    for name, fn in local.items():
        setattr(training, name, fn)
    try:
        # the optimizer's build counts as the optimizer's (e.g. the factory patch that makes
        # Megatron build the adaptor's AdamW)
        with (
            tracer.attributed(training, "get_megatron_optimizer", OPTIMIZER)
            if tracer
            else contextlib.nullcontext()
        ):
            yield
    finally:
        for name, fn in originals.items():
            setattr(training, name, fn)
        path = spec.get("curve")
        if path and torch.distributed.is_initialized():
            if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
                curve.write(path)


def run_rank(payload: dict[str, Any]) -> None:
    """One rank of one script run (a module-level function: :func:`run_warm`'s target)."""
    from megatron_npu import run_script
    from megatron_npu.ops.kernels import NATIVE_ENV
    from megatron_npu.patcher import DISABLE_ENV

    os.environ[run_script.DEVICE_ENV] = payload["device"]
    os.environ[DISABLE_ENV] = ",".join(payload.get("disable", ()))
    os.environ[NATIVE_ENV] = ",".join(payload.get("native_kernels", ()))
    script = run_script.prepare([payload["script"], *payload["argv"]])
    hooked = payload.get("hooks")
    with _hooks(hooked) if hooked else contextlib.nullcontext():
        try:
            run_script.run(script)
        except SystemExit as exc:  # Megatron-LM exits 0 at --exit-interval
            if exc.code not in (None, 0):
                raise


def run(
    spec: dict[str, Any],
    world: int,
    timeout_s: float,
    log: Path,
    *,
    env: dict[str, str],
) -> None:
    """The runs of one locate ``spec`` (``script``, ``script_args``, ``device``, ``disable`` and
    the step fields of :func:`replay_arguments`), one after another, under ``env`` (the locate
    run's :func:`~.worker.replay_environment`) with what the script needs; raises
    :class:`~.worker.WorkerError` naming the failed run with its log's tail."""
    from megatron_npu.locate.worker import WorkerError
    from megatron_npu.run_script import environment
    from megatron_npu.training.launch import RankFailure, run_warm

    env = {**env, **environment(spec["script"])}
    runs = replay_arguments(spec)
    for index, argv in enumerate(runs):
        last = index == len(runs) - 1
        payload = {
            "script": spec["script"],
            "argv": argv,
            "device": spec["device"],
            "disable": list(spec.get("disable", ())),
            "native_kernels": list(spec.get("native_kernels", ())),
            "hooks": spec if last and (spec.get("hook_step") or spec.get("curve")) else None,
        }
        name = log if last else log.with_name(f"{log.stem}-save{log.suffix}")
        try:
            run_warm(run_rank, payload, world, timeout_s=timeout_s, log=name, env=env)
        except RankFailure as exc:
            raise WorkerError(f"{Path(spec['script']).name} run ({name.name}) {exc}") from None
