"""``python -m megatron_npu.train`` / ``torchrun -m megatron_npu.train``: GPT pretraining.

Same options as ``megatron-npu train`` (see :mod:`megatron_npu.training.arguments`). With
``--nproc-per-node N`` this process starts ``N`` ranks, each
running :func:`main` of this module; under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_*`` set) or without ``--nproc-per-node`` it is one rank. The launcher process itself
only parses and checks the options, the data files and the ``--load`` checkpoint
(:mod:`megatron_npu.training.preflight`; it never imports the model stack), then starts and
watches the ranks (:mod:`megatron_npu.training.launch`). A fault in the input ends the run with
one named message and exit status 2 (:mod:`megatron_npu.training.errors`); ``--metrics-out`` and
``--save`` are held for the run (:mod:`megatron_npu.training.run_lock`).
"""

from __future__ import annotations

import copy
import os
import sys

from megatron_npu import console
from megatron_npu.patches import jit_fusions
from megatron_npu.training import (
    arguments,
    errors,
    launch,
    preflight,
    quiet_expected_warnings,
    run_lock,
    security,
)


def main(argv: list[str] | None = None) -> int:
    security.set_umask()  # 027: what training writes is at most 0640 / 0750
    quiet_expected_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = arguments.parse_args(argv)  # fail fast, before any rank starts
    launched_rank = "RANK" in os.environ
    if args.nproc_per_node is not None and launched_rank:
        console.warn(
            " megatron-npu train: already a launched rank (RANK is set): "
            "ignoring --nproc-per-node/--nnodes/--node-rank"
        )
        argv = launch.strip_launch_options(argv)
    starts_ranks = args.nproc_per_node is not None and not launched_rank
    try:
        if os.environ.get(preflight.DONE_ENV) != "1":  # the launcher checked already
            world = (
                args.nproc_per_node * args.nnodes
                if starts_ranks
                else int(os.environ.get("WORLD_SIZE", "1"))
            )
            # the world-size rules, data files, --save and the --load checkpoint
            for note in preflight.check(arguments.finalize(copy.copy(args), world)):
                if os.environ.get("RANK", "0") == "0":
                    console.say(note)
            if os.environ.get("RANK", "0") == "0":  # held until this process ends the run
                if args.metrics_out:
                    run_lock.hold(args.metrics_out, "--metrics-out")
                if args.save:
                    run_lock.hold(args.save, "--save", directory=True)
    except errors.TrainingInputError as exc:
        return errors.report(exc)
    try:
        if starts_ranks:
            return launch.launch(argv, args)
        jit_fusions.load_eagerly(args.device)
        from megatron_npu.training import loop

        return loop.run(argv)
    finally:
        run_lock.release_all()


if __name__ == "__main__":
    launch.arm_rank()  # a rank of megatron-npu's launcher dies with it
    sys.exit(main())
