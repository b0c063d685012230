"""The ``megatron-npu`` command line."""

from __future__ import annotations

import argparse
import sys

from megatron_npu.devices import NAMES, DeviceUnavailableError
from megatron_npu.patcher import PatchError, add_disable_patch_argument


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
        print(f"megatron-npu preprocess: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {summary['prefix']}.{{bin,idx}}: {summary['documents']} documents, "
        f"{summary['tokens']} tokens ({summary['dtype']}), vocab {summary['vocab_size']}, "
        f"{summary['seconds']} s"
    )
    return 0


def _parity(args: argparse.Namespace) -> int:
    from parity import runner

    return runner.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-npu", description="Megatron-Core on Ascend NPU, with a CPU parity harness"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="device, versions and the status of every patch")
    p_info.add_argument("--device", choices=NAMES, default=None, help="default: auto-detect")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    add_disable_patch_argument(p_info)
    p_info.set_defaults(func=_info)
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
    p_pre.set_defaults(func=_preprocess)
    p_parity = sub.add_parser(
        "parity", help="check every patched function against its CPU reference"
    )
    from parity.runner import add_arguments as add_parity_arguments

    add_parity_arguments(p_parity)
    add_disable_patch_argument(p_parity)
    p_parity.set_defaults(func=_parity)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # train parses its own (Megatron-named) options
        switch = argparse.ArgumentParser(prog="megatron-npu train", add_help=False)
        add_disable_patch_argument(switch)
        _, train_argv = switch.parse_known_args(argv[1:])
        return _train(argparse.Namespace(train_argv=train_argv))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (DeviceUnavailableError, PatchError) as exc:
        print(f"megatron-npu: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
