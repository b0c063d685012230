"""``megatron-npu parity`` runs the generated matrix through pytest and summarises the records."""

from __future__ import annotations

import subprocess
import sys

from parity.results import read_records


def _run(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "parity", "--results", str(tmp_path), *args],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip


def test_parity_cli_writes_records_and_a_summary(tmp_path):
    proc = _run(tmp_path, "--quick", "--device", "cpu", "--device", "npu-emulated",
                "-k", "data.build-sample-idx")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list(tmp_path.glob("run-*-quick"))
    assert len(runs) == 1
    records = read_records(runs[0])
    assert {r.device for r in records} == {"cpu", "npu-emulated"}
    assert all(r.patch_id == "data.build-sample-idx" for r in records)
    assert "2 records: 2 pass" in proc.stdout
    assert "parity results" in proc.stdout


def test_parity_cli_fails_when_nothing_ran(tmp_path):
    proc = _run(tmp_path, "--quick", "--device", "cpu", "-k", "no-such-patch")
    assert proc.returncode != 0
    assert "no records were written" in proc.stderr
