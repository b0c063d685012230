"""Process faults on real 2-rank runs of the smallest model (a rank that dies, hangs or is killed).

* a rank killed (SIGKILL) late in a checkpoint save, and a save that runs out of disk space:
  the run stops at once with a message naming the rank / ``--save``, the tracker still names
  the previous checkpoint, which loads and resumes the uninterrupted run's losses exactly;
* a rank killed during training, SIGINT to the launcher, SIGKILL to the launcher: every rank
  (and checkpoint writer) is gone afterwards;
* ``metrics.json`` is valid JSON (or absent) whatever happened.

Fault points are injected with the test-only ``$MEGATRON_NPU_TEST_FAULT`` hook
(:mod:`megatron_npu.training.checkpointing`) or with real signals.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from megatron_npu.training import arguments, preflight

from ._harness import TINY, assert_no_orphans, processes_mentioning, run, start, wait_for_line

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

FAULT_ENV = "MEGATRON_NPU_TEST_FAULT"
TWO_RANKS = ["--nproc-per-node", "2"]
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")


def logged_losses(out: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in LOSS_LINE.finditer(out)}


def tracker(save: Path) -> str:
    return (save / "latest_checkpointed_iteration.txt").read_text().strip()


def strict_json(path: Path):
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def assert_checkpoint_passes_checks(save: Path) -> None:
    args = arguments.parse_args([*TINY, "--load", str(save)])
    assert preflight.check(arguments.finalize(args, 1)) == []


def test_rank_killed_late_in_save_keeps_previous_checkpoint(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    code, out = run(
        *TINY,
        *TWO_RANKS,
        "--save",
        str(save),
        "--save-interval",
        "2",
        "--metrics-out",
        str(metrics),
        env={FAULT_ENV: "save-sigkill:4:1"},
    )
    assert code == 1, out
    assert "rank 1 was killed by SIGKILL; stopped the other ranks" in out, out
    assert "Traceback" not in out, out
    assert_no_orphans(str(save))
    assert tracker(save) == "2" and not (save / "iter_0000004").exists()
    assert strict_json(metrics)["steps"][-1]["step"] == 4  # written before the save, whole
    assert_checkpoint_passes_checks(save)
    # the previous checkpoint loads, and steps 3-4 repeat the killed run's losses (DP2 -> DP1)
    resumed = tmp_path / "resumed.json"
    code, out2 = run(*TINY, "--load", str(save), "--metrics-out", str(resumed))
    assert code == 0, out2
    assert "loaded checkpoint" in out2 and "iter_0000002" in out2
    again = {s["step"]: s["lm_loss"] for s in strict_json(resumed)["steps"]}
    before = logged_losses(out)
    assert sorted(again) == [3, 4]
    for step in (3, 4):  # the console prints 6 significant digits
        assert f"{again[step]:.6E}" == f"{before[step]:.6E}", (again, before)


def test_disk_full_mid_save_is_a_named_error(tmp_path):
    save = tmp_path / "ckpt"
    code, out = run(
        *TINY,
        *TWO_RANKS,
        "--save",
        str(save),
        "--save-interval",
        "2",
        env={FAULT_ENV: "save-enospc:4"},
    )
    assert code == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out
    assert f"--save {save}: no space left on the device while saving iteration 4" in errors[0]
    assert "the previous checkpoint (iteration 2) is intact" in errors[0]
    assert_no_orphans(str(save))
    assert tracker(save) == "2" and not (save / "iter_0000004").exists()
    assert_checkpoint_passes_checks(save)


def _rank_pid(launcher: int, rank: int) -> int:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[1])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no rank {rank} under launcher {launcher}")


def _long_run(tmp_path: Path, name: str):
    marker = tmp_path / f"{name}.metrics.json"
    proc = start(
        *TINY[:-8],
        "--train-iters",
        "100000",
        "--log-interval",
        "1",
        "--progress",
        "plain",
        *TWO_RANKS,
        "--metrics-out",
        str(marker),
    )
    lines: list[str] = []
    wait_for_line(proc, "iteration        1/", lines)
    return proc, marker, lines


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_rank_killed_during_training_ends_the_run(sig, tmp_path):
    """The killed rank is the one named, also when the signal is the SIGTERM the launcher
    stops the other ranks with."""
    proc, marker, lines = _long_run(tmp_path, f"kill-rank-{sig.name}")
    os.kill(_rank_pid(proc.pid, 1), sig)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out
    assert f"rank 1 was killed by {sig.name}" in out and "Traceback" not in out, out
    assert_no_orphans(str(marker))
    if marker.exists():
        strict_json(marker)


def test_sigint_to_launcher_stops_all_ranks(tmp_path):
    proc, marker, lines = _long_run(tmp_path, "sigint")
    assert len(processes_mentioning(str(marker))) == 3  # the launcher and two ranks
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "SIGINT received: stopped all 2 ranks" in out and "Traceback" not in out, out
    assert_no_orphans(str(marker))


def test_killed_launcher_takes_its_ranks_along(tmp_path):
    proc, marker, _ = _long_run(tmp_path, "kill-launcher")
    proc.kill()
    proc.communicate(timeout=120)
    assert_no_orphans(str(marker))  # parent-death signal


def test_input_fault_through_the_real_launcher(tmp_path):
    """End to end: exit status 2, one line, no traceback, no rank started."""
    code, out = run(*TINY, *TWO_RANKS, "--lr", "nan")
    assert code == 2 and "Traceback" not in out, out
    assert [line for line in out.splitlines() if "error:" in line] == [
        "megatron-npu train: error: argument --lr: must be a finite number, got 'nan'"
    ]
    code, out = run(*TINY, *TWO_RANKS, "--load", str(tmp_path / "absent"))
    assert code == 2 and "Traceback" not in out and "world" not in out, out
    assert out.count("error:") == 1 and "--load-optional" in out, out


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("protected", [True, False])
def test_forked_writer_dies_with_its_rank(protected, method, tmp_path):
    """What a rank does for torch_dist's forked checkpoint writers and for the processes
    multiprocessing spawns (Megatron's results Manager, the resource tracker): with
    ``children.tie_children`` they die with it; the unprotected control shows the check can fail
    (the children outlive their killed parent)."""
    import subprocess
    import sys

    from ._harness import REPO, alive, descendants, run_env

    script = (
        "import contextlib, multiprocessing, os, time\n"
        "from megatron_npu.training import children\n"
        f"with children.tie_children() if {protected} else contextlib.nullcontext():\n"
        f"    if {method!r} == 'fork':\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(600)\n"
        "            os._exit(0)\n"
        "    else:\n"
        "        ctx = multiprocessing.get_context('spawn')\n"
        "        ctx.Process(target=time.sleep, args=(600,)).start()\n"
        "    print('forked', flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "forked"
    tree = descendants(proc.pid)
    assert len(tree) == (1 if method == "fork" else 2), tree  # spawn: the child and the tracker
    proc.kill()
    proc.wait()
    left = alive(tree, deadline_s=30.0 if protected else 2.0)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    if protected:
        assert not left, f"processes outlived their parent: {left}"
    else:
        assert left, "the unprotected children should have outlived their parent"


@pytest.mark.parametrize("armed", [True, False])
def test_a_rank_dies_with_its_killed_launcher(armed):
    """What a rank's first step (``launch.arm_rank``) does: torch elastic starts the rank in a
    session of its own, with no parent-death signal; armed, the rank dies with a launcher killed
    by SIGKILL; the control, a rank with no launcher's pid to check, outlives it."""
    import subprocess
    import sys

    from ._harness import REPO, alive, run_env

    rank = (
        "import time\n"
        "from megatron_npu.training import launch\n"
        "launch.arm_rank()\n"
        "print('armed', flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = (
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, RANK='0')\n"
        f"if {armed}:\n"
        "    env['MEGATRON_NPU_LAUNCHER_PID'] = str(os.getpid())\n"
        f"child = subprocess.Popen([sys.executable, '-c', {rank!r}], env=env,\n"
        "                         start_new_session=True, stdout=subprocess.PIPE, text=True)\n"
        "assert child.stdout.readline().strip() == 'armed'\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher], cwd=REPO, env=run_env(), stdout=subprocess.PIPE, text=True
    )
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    left = alive([child], deadline_s=30.0 if armed else 2.0)
    for pid in left:  # never leave it to the next test
        os.kill(pid, signal.SIGKILL)
    assert bool(left) is not armed, f"armed={armed}: left {left}"


def test_a_rank_whose_launcher_is_gone_exits_at_once():
    """A launcher that died before its rank armed the signal: the rank's parent is no longer
    the launcher it names, so it exits instead of training alone."""
    import subprocess
    import sys

    from ._harness import REPO, run_env

    code = "from megatron_npu.training import launch; launch.arm_rank(); print('trained alone')"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**run_env(), "RANK": "0", "MEGATRON_NPU_LAUNCHER_PID": str(os.getpid() + 10**6)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (1, ""), done
