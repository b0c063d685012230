"""``megatron-npu report INPUT... -o report.html [--diff-base OLD...]``."""

from __future__ import annotations

import argparse

from megatron_npu.reports.errors import ReportInputError

from megatron_npu import console


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="parity results folders, compare output folders, pytest-benchmark JSON files, "
        "info --json files (any mix; the kind is read from the content)",
    )
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write")
    parser.add_argument(
        "--diff-base",
        nargs="+",
        metavar="OLD",
        default=None,
        help="an older result set: the page then opens with what changed against it",
    )


def main(args: argparse.Namespace) -> int:
    from megatron_npu.reports.build import build_report

    try:
        path = build_report(args.inputs, args.output, diff_base=args.diff_base)
    except (ReportInputError, OSError) as exc:
        console.error(f"megatron-npu report: {exc}")
        return 2
    console.say(f"report written to {path}")
    return 0
