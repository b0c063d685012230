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
    """``info`` imports megatron-core (it reads the installed release's patch targets)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if asked:
        env["PYTHONWARNINGS"] = "default"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "info"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "megatron-core" in proc.stdout, proc.stdout[-2000:]
    assert (NOTICE in proc.stderr) == asked, proc.stderr[-2000:]


def test_help_and_the_launcher_do_not_import_megatron_core():
    """A command's help, and ``train``'s launcher up to starting its ranks, need no megatron-core:
    each rank imports it, so the launcher importing it too would add its start-up time (several
    seconds) to every multi-rank run."""
    code = (
        "import sys\n"
        "from megatron_npu import cli, train\n"
        "from megatron_npu.training import arguments, launch, preflight\n"
        "for command in ('locate', 'train', 'evaluate', 'compare', 'preprocess'):\n"
        "    try:\n"
        "        cli.main([command, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "args = arguments.parse_args(['--mock-data', '--train-iters', '1', '--num-layers', '2',\n"
        "    '--hidden-size', '64', '--num-attention-heads', '4', '--seq-length', '32',\n"
        "    '--micro-batch-size', '2', '--lr', '1e-3', '--nproc-per-node', '2'])\n"
        "list(preflight.check(arguments.finalize(args, 2)))\n"
        "print('megatron.core' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout[-2000:]
