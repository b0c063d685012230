"""``megatron-npu parity``: run the parity matrix through pytest and print the summary table.

pytest does the work (``-p megatron_npu.parity.plugin`` on :mod:`megatron_npu.parity.cells_test`,
pytest-xdist for ``-n``); every cell writes its record into a fresh run directory, which is read
back at the end for the summary, so the table shows exactly what this run produced.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_npu.parity.results import read_records
from megatron_npu.parity.summary import print_summary, summary_lines

from megatron_npu import console
from megatron_npu.devices.facts import CPU, CUDA, DEVICE_ORDER, NPU, NPU_EMULATED

CI_DEVICES = (CPU, NPU_EMULATED)


def available_devices() -> list[str]:
    """cpu and npu-emulated always; npu and cuda when this machine has them."""
    from megatron_npu import devices

    return [*CI_DEVICES, *(name for name in (NPU, CUDA) if devices.available(name))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        action="append",
        dest="devices",
        metavar="DEVICE",
        choices=DEVICE_ORDER,
        help="device to check (repeatable); default: cpu, npu-emulated, and npu/cuda if present",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="few examples per cell (the CI setting; default)",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="many hypothesis-drawn examples per cell",
    )
    parser.set_defaults(mode="quick")
    parser.add_argument(
        "-n", "--workers", type=int, default=1, help="parallel pytest-xdist workers (default 1)"
    )
    parser.add_argument(
        "--results",
        default=os.path.join("results", "parity"),
        help="parent directory; each run writes into a new run-* folder",
    )
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k filter on cell ids")


#: the test module pytest collects: the generated cells imported under their package name, so a
#: source checkout never loads ``parity/cells_test.py`` a second time as ``parity.cells_test``
ENTRY_MODULE = "from megatron_npu.parity.cells_test import pytest_generate_tests, test_parity\n"
ENTRY_NAME = "test_parity_cells.py"

#: Megatron's import-time notices (no TE/apex: the adaptor serves those paths) stay out of the
#: summary; every other warning is shown (three of pyproject's filterwarnings, repeated here: an
#: installed package has no pyproject to read them from)
QUIET_WARNINGS = (
    "ignore:.*Transformer Engine and Apex are not installed.*:UserWarning",
    "ignore:Apex is not installed.*:UserWarning",
    "ignore::DeprecationWarning:megatron",
)

#: what ``megatron-npu parity`` runs on (the ``parity`` extra installs them)
REQUIRED = {"pytest": "pytest", "hypothesis": "hypothesis"}
REQUIRED_FOR_WORKERS = {"xdist": "pytest-xdist"}


def missing_requirements(workers: int) -> list[str]:
    """The distributions the run needs that are not installed."""
    needed = dict(REQUIRED)
    if workers > 1:
        needed.update(REQUIRED_FOR_WORKERS)
    return [dist for module, dist in needed.items() if importlib.util.find_spec(module) is None]


def pytest_command(
    args: argparse.Namespace, devices: list[str], run_dir: Path, entry_dir: Path
) -> list[str]:
    entry = entry_dir / ENTRY_NAME
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(entry),
        "-p",
        "megatron_npu.parity.plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "--rootdir",
        str(entry_dir),
        f"--parity-mode={args.mode}",
        f"--parity-devices={','.join(devices)}",
        f"--parity-results={run_dir}",
    ]
    for rule in QUIET_WARNINGS:
        cmd += ["-W", rule]
    if args.workers > 1:
        cmd += ["-n", str(args.workers)]
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd


def main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit(f"megatron-npu parity: -n must be >= 1, got {args.workers}")
    missing = missing_requirements(args.workers)
    if missing:
        raise SystemExit(
            f"megatron-npu parity needs {', '.join(missing)}, which is not installed: "
            "pip install 'megatron-npu[parity]'"
        )
    devices = args.devices or available_devices()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_dir = Path(args.results) / f"run-{stamp}-{args.mode}"
    run_dir.mkdir(parents=True, exist_ok=False, mode=0o750)
    console.say(f"parity: {args.mode} run on {', '.join(devices)}; records in {run_dir}")
    with tempfile.TemporaryDirectory(prefix="megatron-npu-parity-") as entry_dir:
        (Path(entry_dir) / ENTRY_NAME).write_text(ENTRY_MODULE, encoding="utf-8")
        code = subprocess.call(pytest_command(args, devices, run_dir, Path(entry_dir)))
    records = read_records(run_dir)
    if records:
        print_summary(records)
    for line in summary_lines(records):
        console.say(line)
    if not records:
        console.error("parity: no records were written")
        return code or 1
    return code
