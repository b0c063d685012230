"""The ``megatron-npu`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_npu import console
from megatron_npu.devices import NAMES, DeviceUnavailableError
from megatron_npu.disable_patch_option import add_disable_patch_argument, disable_flag_published
from megatron_npu.patcher import PatchError


def _info(args: argparse.Namespace) -> int:
    from megatron_npu import info

    return info.main(args.device, args.json)


def _train(args: argparse.Namespace) -> int:
    from megatron_npu.train import main

    return main(args.train_argv)


def _preprocess(args: argparse.Namespace) -> int:
    from megatron_npu.data.preprocess import PreprocessError, run_preprocess

    try:
        summary = run_preprocess(args)
    except (PreprocessError, OSError) as exc:
        console.error(f"megatron-npu preprocess: {exc}")
        return 2
    console.say(
        f"wrote {summary['prefix']}.{{bin,idx}}: {summary['documents']} documents, "
        f"{summary['tokens']} tokens ({summary['dtype']}), vocab {summary['vocab_size']}, "
        f"{summary['seconds']} s"
    )
    return 0


#: subcommands whose module provides ``add_arguments(parser)`` and ``main(args)``; imported only
#: when the parser is built, so ``megatron-npu`` itself stays light
_DELEGATED = {
    "parity": (
        "megatron_npu.parity.runner",
        "check every patched function against its CPU reference",
    ),
    "report": (
        "megatron_npu.reports.cli",
        "one self-contained HTML page from parity, compare and benchmark results",
    ),
    "compare": (
        "megatron_npu.compare.command",
        "run a matrix of training configurations and judge them (Table 2)",
    ),
    "locate": (
        "megatron_npu.locate.command",
        "the first divergent step, module and patch between two runs",
    ),
}


def _delegate(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).main(args)

    return run


def _evaluate(args: argparse.Namespace) -> int:
    from megatron_npu.evaluate.command import main

    return main(args.evaluate_argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-npu", description="Megatron-Core on Ascend NPU, with a CPU parity harness"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="device, versions and the status of every patch")
    p_info.add_argument("--device", choices=NAMES, default=None, help="default: auto-detect")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    add_disable_patch_argument(p_info)
    p_info.set_defaults(func=_info, command_parser=p_info)
    p_train = sub.add_parser(
        "train",
        help="GPT pretraining on Megatron-Core (Megatron's options; --help for the list)",
        add_help=False,
    )
    p_train.set_defaults(func=_train)
    p_pre = sub.add_parser(
        "preprocess", help="tokenize JSONL/text into Megatron's indexed dataset (.bin/.idx)"
    )
    from megatron_npu.data.preprocess import add_preprocess_args

    add_preprocess_args(p_pre)
    p_pre.set_defaults(func=_preprocess, command_parser=p_pre)
    for name, (module, help_text) in _DELEGATED.items():
        p_sub = sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(p_sub)
        if name == "parity":
            add_disable_patch_argument(p_sub)
        p_sub.set_defaults(func=_delegate(module), command_parser=p_sub)
    p_evaluate = sub.add_parser(
        "evaluate", help="zero-shot evaluation of a checkpoint (--task lambada)", add_help=False
    )
    p_evaluate.set_defaults(func=_evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # train parses its own (Megatron-named) options
        switch = argparse.ArgumentParser(prog="megatron-npu train", add_help=False)
        add_disable_patch_argument(switch)
        switches, train_argv = switch.parse_known_args(argv[1:])
        with disable_flag_published(switches.disable_patch):
            return _train(argparse.Namespace(train_argv=train_argv))
    if argv[:1] == ["evaluate"]:  # evaluate takes train's model options too
        return _evaluate(argparse.Namespace(evaluate_argv=argv[1:]))
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # named by the command that was given them, with that command's usage
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with disable_flag_published(getattr(args, "disable_patch", ())):
            return args.func(args)
    except (DeviceUnavailableError, PatchError) as exc:
        console.error(f"megatron-npu: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
