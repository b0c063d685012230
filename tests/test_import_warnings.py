"""Commands do not open with megatron-core's "Transformer Engine and Apex are not installed"
warnings (the adaptor's fallbacks are the intended path), unless the user asks for warnings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

NOTICE = "Transformer Engine and Apex are not installed"


@pytest.mark.parametrize("asked", [False, True], ids=["quiet", "PYTHONWARNINGS=default"])
def test_megatron_core_import_notices_only_when_asked(asked):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if asked:
        env["PYTHONWARNINGS"] = "default"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "locate", "--help"],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: megatron-npu locate" in proc.stdout
    assert (NOTICE in proc.stderr) == asked, proc.stderr[-2000:]
