"""``python -m megatron_npu.run_script SCRIPT``: what it cannot run is one named line on standard
error and exit status 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_script(tmp_path: Path, script: Path, device: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEGATRON_NPU_DEVICE": device, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "megatron_npu.run_script", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("device", "script", "line"),
    [
        (
            "gpu",
            "train.py",
            "megatron-npu run_script: $MEGATRON_NPU_DEVICE='gpu' is not a device: choose one of "
            "cpu, npu, npu-emulated, cuda",
        ),
        # no torch_npu here: the device says what it needs
        ("npu", "train.py", "megatron-npu run_script: device 'npu' needs torch_npu"),
        ("cpu", "missing.py", "megatron-npu run_script: no script"),
    ],
)
def test_what_cannot_run_is_one_named_line(tmp_path, device, script, line):
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    proc = _run_script(tmp_path, tmp_path / script, device)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr
    assert "the script ran" not in proc.stderr + proc.stdout
