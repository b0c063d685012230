"""The ``megatron-npu`` command line."""

from __future__ import annotations

import argparse
import sys

from megatron_npu.devices import NAMES, DeviceUnavailableError


def _info(args: argparse.Namespace) -> int:
    from megatron_npu import info

    return info.main(args.device, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-npu", description="Megatron-Core on Ascend NPU, with a CPU parity harness"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="device, versions and the status of every patch")
    p_info.add_argument("--device", choices=NAMES, default=None, help="default: auto-detect")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    p_info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DeviceUnavailableError as exc:
        print(f"megatron-npu: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
