"""One run of one configuration, in its own process per rank (``python -m
megatron_npu.locate.worker SPEC.json``).

It builds the trainer exactly as ``megatron-npu train`` does (:func:`megatron_npu.training.loop.
build_trainer` with train's own options, the adaptor applied for the spec's device minus its
``disable`` list) and then, step by step:

* ``stop``: the last step to run (the LR schedule still follows ``--train-iters``);
* ``load``: start from this checkpoint (train's own format, :mod:`~megatron_npu.training.
  checkpointing`) instead of step 0;
* ``save_before``: save a checkpoint there just before step ``hook_step`` (the replay point that
  the other run then loads);
* ``hook_step`` + ``dump``: record that step with :class:`~.dump.Recorder` into ``dump``;
* ``curve``: write the loss curve (rank 0;
  :class:`megatron_npu.formats.locate_curve.LocateCurve`);
* ``native_kernels``: torch_npu kernels the op layer serves natively in this run
  (:mod:`megatron_npu.ops.kernels`), the patches that call them staying installed;
* ``trial``: a culprit trial -- ``--use-flash-attn`` with the ``attention.*`` patch switched off
  runs Megatron's unfused attention instead of being refused as ``train`` refuses it.

``plant`` (testing aid: locate's hidden ``--plant-candidate``) puts one of the parity harness's
planted bugs (:mod:`megatron_npu.parity.mutations`) in place in this process for the whole run.

:func:`run` starts the ranks (``world`` processes with torchrun's environment variables, forked
warm by :func:`megatron_npu.training.launch.run_warm`) and waits for them; a failure raises
:class:`WorkerError` with the log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any


class WorkerError(RuntimeError):
    """A worker run failed (its log's tail is in the message)."""


def _plant(name: str | None):
    if not name:
        return contextlib.nullcontext()
    from megatron_npu.parity.mutations import planted

    return planted(name)


def _coords() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    coords = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }
    if ps.get_context_parallel_world_size() > 1:  # each CP rank holds its own rows
        coords["cp"] = ps.get_context_parallel_rank()
    return coords


def _optimizer_build_traced(tracer):
    """The patches that run while the optimizer is built count as the optimizer's (e.g. the
    factory patch that makes Megatron build the adaptor's AdamW)."""
    from megatron_npu.locate.dump import OPTIMIZER
    from megatron_npu.training import optimizer as optim_mod

    if tracer is None:
        return contextlib.nullcontext()
    return tracer.attributed(optim_mod, "build", OPTIMIZER)


def _run_rank(spec: dict[str, Any]) -> None:
    import torch

    from megatron_npu import patcher
    from megatron_npu.formats.locate_curve import LocateCurve
    from megatron_npu.locate.dump import DEFAULT_LIMIT, OPTIMIZER, Recorder, write_meta
    from megatron_npu.locate.trace import Tracer
    from megatron_npu.ops.kernels import NATIVE_ENV, served_natively
    from megatron_npu.training import (
        arguments,
        checkpointing,
        launch,
        loop,
        quiet_expected_warnings,
    )
    from megatron_npu.training import data as data_mod
    from megatron_npu.training import model as model_mod
    from megatron_npu.training.rank_session import rank_session

    quiet_expected_warnings()
    args = arguments.parse_args(list(spec["argv"]))
    env = launch.dist_env(args.master_addr, args.master_port)
    os.environ[NATIVE_ENV] = ",".join(spec.get("native_kernels", ()))
    hook_step = spec.get("hook_step")
    # a culprit trial may switch the fused attention patch off: Megatron's unfused path runs
    with rank_session(
        args, env, disable=spec.get("disable", ()), check_attention=not spec.get("trial")
    ) as device:
        tracer = Tracer() if hook_step else None  # it reads the patches applied
        with _plant(spec.get("plant")):
            with tracer.active(building=True) if tracer else contextlib.nullcontext():
                with _optimizer_build_traced(tracer):
                    trainer = loop.build_trainer(args, env, device)
            model, optimizer = trainer.model, trainer.optimizer
            start = 0
            if spec.get("load"):
                args.load = spec["load"]
                start = checkpointing.load(args, model, optimizer, trainer.scheduler).iteration
            iterators = data_mod.iterators(
                args, trainer.train_data, model, start * args.global_batch_size
            )
            for chunk in model:
                chunk.train()
            curve = LocateCurve.empty()
            for step in range(start + 1, int(spec["stop"]) + 1):
                if step == hook_step:
                    if spec.get("save_before"):
                        args.save = spec["save_before"]
                        checkpointing.save(args, model, optimizer, trainer.scheduler, step - 1)
                    chunks = [model_mod.unwrap(c) for c in model]
                    recorder = Recorder(
                        chunks, tracer, int(spec.get("limit", DEFAULT_LIMIT)), args.num_layers
                    )
                    with tracer.attributed(optimizer, "step", OPTIMIZER):
                        with recorder, tracer.active():
                            loss, grad_norm, _, _ = trainer.step(step, iterators)
                    recorder.record_parameters()
                    rank = torch.distributed.get_rank()
                    recorder.write(spec["dump"], rank, _coords())
                    if rank == 0:
                        write_meta(
                            spec["dump"],
                            step=step,
                            world=env.world_size,
                            device=device.name,
                            dtype=str(model_mod.params_dtype(args)).removeprefix("torch."),
                            argv=list(spec["argv"]),
                            disabled=list(spec.get("disable", ())),
                            plant=spec.get("plant"),
                            loss=loss,
                            grad_norm=grad_norm,
                            npu_kernels=device.kernels is not None,
                            native_kernels=sorted(served_natively()),
                            applied=[
                                r.id for r in patcher.results() if r.status == patcher.APPLIED
                            ],
                        )
                else:
                    loss, grad_norm, _, _ = trainer.step(step, iterators)
                curve.add(step, loss, grad_norm)
            if spec.get("curve") and env.rank == 0:
                curve.write(spec["curve"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    _run_rank(spec)
    return 0


def replay_environment() -> dict[str, str]:
    """The caller's environment without the switches a replay sets itself per rank (its spec's
    disabled patches and natively served kernels are the whole sets)."""
    from megatron_npu.ops.kernels import NATIVE_ENV

    env = dict(os.environ)
    env.pop("MEGATRON_NPU_DISABLE", None)  # the spec's list is the whole disabled set
    env.pop("MEGATRON_NPU_DISABLE_FLAG", None)
    env.pop(NATIVE_ENV, None)  # and its native_kernels the whole natively served set
    return env


def run(
    spec: dict[str, Any],
    world: int = 1,
    timeout_s: float = 900.0,
    log: Path | None = None,
    *,
    env: dict[str, str],
) -> None:
    """Run ``spec`` on ``world`` ranks under ``env`` (the locate run's
    :func:`replay_environment`) and wait; raise :class:`WorkerError` on failure. The ranks start
    warm (:func:`megatron_npu.training.launch.run_warm`): a locate run replays a step many
    times, and each replay would otherwise import Megatron anew."""
    from megatron_npu.training.launch import RankFailure, run_warm
    from megatron_npu.training.main_guard import UnguardedMainError

    try:
        run_warm(_run_rank, spec, world, timeout_s=timeout_s, log=log, env=env)
    except RankFailure as exc:
        raise WorkerError(f"locate worker {exc}") from None
    except UnguardedMainError as exc:
        raise WorkerError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
