"""``python -m megatron_npu.train`` / ``torchrun -m megatron_npu.train``: GPT pretraining.

Same options as ``megatron-npu train`` (see :mod:`megatron_npu.training.arguments`). With
``--nproc-per-node N`` this process starts ``N`` ranks through torch's elastic launcher, each
running :func:`main` of this module; under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_*`` set) or without ``--nproc-per-node`` it is one rank. The launcher process itself
only parses and checks the options (it never imports the model stack).
"""

from __future__ import annotations

import copy
import os
import sys

from megatron_npu.training import arguments, launch, quiet_expected_warnings, security


def main(argv: list[str] | None = None) -> int:
    security.set_umask()  # 027: what training writes is at most 0640 / 0750
    quiet_expected_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = arguments.parse_args(argv)  # fail fast, before any rank starts
    if args.nproc_per_node is not None and "RANK" in os.environ:
        print(
            " megatron-npu train: already a launched rank (RANK is set): "
            "ignoring --nproc-per-node/--nnodes/--node-rank",
            file=sys.stderr,
            flush=True,
        )
        argv = launch.strip_launch_options(argv)
    elif args.nproc_per_node is not None:
        try:  # the world-size rules too, before any rank starts
            arguments.finalize(copy.copy(args), args.nproc_per_node * args.nnodes)
        except arguments.ArgumentError as exc:
            print(f"megatron-npu train: error: {exc}", file=sys.stderr, flush=True)
            return 2
        return launch.launch(argv, args)
    from megatron_npu.training import loop

    return loop.run(argv)


if __name__ == "__main__":
    sys.exit(main())
