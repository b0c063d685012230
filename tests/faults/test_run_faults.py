"""Reliability faults on real runs of the smallest model, each as a careless or
hostile user would meet it.

* kill -9 of the launcher after the run has saved once: no rank, checkpoint writer, results
  ``Manager`` or resource tracker survives, and no ``megatron-npu-errors-*`` folder is left;
* a second run on a live run's ``--master-port`` (or ``--metrics-out``) gets one named error,
  also when it gets past the launcher's check, and the first run trains on unharmed;
* token ids beyond the tokenizer's vocabulary: a named error, not ``IndexError``;
* runs that train nothing stop with exit status 3 and say why, in the metrics file too:
  ``--lr 1e30`` (NaN loss; through the launcher), ``--fp16`` on cpu (every step skipped), a
  resume with ``--use-checkpoint-opt_param-scheduler`` past the checkpoint's schedule (lr 0);
  ``--no-divergence-stop`` lets such a run end with 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.megatron_lm._client import free_port

from ._harness import (
    TINY,
    alive,
    descendants,
    run,
    start,
    wait_for_line,
    write_indexed_dataset,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TWO_RANKS = ["--nproc-per-node", "2"]


def _long(*extra: str) -> list[str]:
    argv = list(TINY)
    argv[argv.index("--train-iters") + 1] = "100000"
    return [*argv, *extra]


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "error:" in line or "stopped:" in line]


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.extended), 1])
def test_killed_launcher_after_a_save_leaves_no_process_and_no_folder(ranks, tmp_path):
    """``ranks=1``: no launcher of its own, the one process is the run (and is killed)."""
    # the run's own TMPDIR (other runs on this machine stay out), short: multiprocessing's
    # Manager binds a Unix socket in it, and a path past 108 bytes (xdist's popen-gwN folders
    # under tmp_path) makes the socket fail and the Manager die at start
    private_tmp = Path(tempfile.mkdtemp(prefix="mnpu-"))
    launch = TWO_RANKS if ranks == 2 else []
    proc = start(
        *_long(*launch, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"),
        env={"TMPDIR": str(private_tmp)},
    )
    lines: list[str] = []
    wait_for_line(proc, "saved checkpoint at iteration 1", lines)
    tree = descendants(proc.pid)
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in tree}
    # the ranks, and what their first save spawned (results Manager, resource tracker)
    ranks_seen = sum(b"megatron_npu.train" in c for c in commands.values())
    assert ranks_seen == (2 if ranks == 2 else 0), commands
    assert any(b"multiprocessing" in c for c in commands.values()), commands
    proc.kill()
    proc.communicate(timeout=60)
    left = alive(tree)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, {pid: commands[pid][:200] for pid in left}
    assert not [p.name for p in private_tmp.iterdir() if p.name.startswith("megatron-npu-")]
    shutil.rmtree(private_tmp, ignore_errors=True)


def test_second_run_on_a_busy_port_is_refused_and_harms_nothing(tmp_path):
    port = str(free_port())
    metrics = tmp_path / "first.json"
    first = start(*_long(*TWO_RANKS, "--master-port", port, "--metrics-out", str(metrics)))
    lines: list[str] = []
    wait_for_line(first, "iteration        2/", lines)
    try:
        busy = (
            f"megatron-npu train: error: --master-port {port} is already in use on this machine "
            "(another run, or another program, listens on it); give another --master-port, or "
            "leave it out to take a free one"
        )
        code, out = run(*TINY, *TWO_RANKS, "--master-port", port)  # the launcher's check
        assert (code, _error_lines(out)) == (2, [busy]), out
        assert "world" not in out  # no rank started
        # past the check (the port taken in between): the launcher's bind names it, and no
        # "another rank stopped"
        code, out = run(
            *TINY, *TWO_RANKS, "--master-port", port, env={"MEGATRON_NPU_PREFLIGHT_DONE": "1"}
        )
        assert (code, _error_lines(out)) == (2, [busy]), out
        assert "another rank stopped" not in out and "Traceback" not in out, out
        # the same --metrics-out, another port
        code, out = run(*TINY, *TWO_RANKS, "--metrics-out", str(metrics))
        assert code == 2 and len(_error_lines(out)) == 1, out
        assert f"--metrics-out {metrics} is in use by another live run" in out, out
        # the first run trains on
        seen = len(lines)
        for line in first.stdout:
            lines.append(line)
            if "iteration" in line and len(lines) > seen + 4:
                break
        assert first.poll() is None, "".join(lines)[-3000:]
    finally:
        first.send_signal(signal.SIGINT)
        rest = first.communicate(timeout=120)[0]
    out = "".join(lines) + rest
    assert first.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "another rank stopped" not in out and "Traceback" not in out, out[-3000:]


def test_token_ids_beyond_the_vocabulary_are_a_named_error(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "corpus")
    raw = bytearray(Path(f"{prefix}.bin").read_bytes())
    raw[40:42] = np.array([5000], dtype="<u2").tobytes()
    Path(f"{prefix}.bin").write_bytes(bytes(raw))
    argv = [a for a in TINY if a != "--mock-data"]
    code, out = run(*argv, "--tokenizer-type", "ByteLevel", "--data-path", str(prefix))
    assert code == 2 and "Traceback" not in out and "IndexError" not in out, out[-3000:]
    assert _error_lines(out) == [
        f"megatron-npu train: error: --data-path {prefix}: token id 5000 is outside the "
        "tokenizer's vocabulary (ids 0..256); preprocess the data with the tokenizer this run "
        "uses (the same --tokenizer-type, --vocab-file and --merge-file)"
    ], out[-3000:]


def _strict(path: Path) -> dict:
    def refuse(token):
        raise ValueError(token)

    return json.loads(path.read_text(), parse_constant=refuse)


def test_diverged_run_stops_with_exit_3_through_the_launcher(tmp_path):
    metrics, save = tmp_path / "metrics.json", tmp_path / "ckpt"
    argv = list(TINY)
    argv[argv.index("--lr") + 1] = "1e30"
    code, out = run(
        *argv,
        *TWO_RANKS,
        "--metrics-out",
        str(metrics),
        "--save",
        str(save),
        "--save-interval",
        "2",
    )
    assert code == 3 and "Traceback" not in out, out[-3000:]
    lines = _error_lines(out)
    assert len(lines) == 1 and lines[0].startswith(
        "megatron-npu train: stopped: the lm loss was "
    ), out
    assert "the run diverged" in lines[0] and "--no-divergence-stop" in lines[0], lines
    stopped = _strict(metrics)["summary"]["stopped"]
    assert stopped["reason"] == "nonfinite-loss" and stopped["exit_status"] == 3, stopped
    assert stopped["iteration"] == 4 and len(_strict(metrics)["steps"]) == 4
    # a step whose loss is NaN/inf is not saved: the last good checkpoint stays the latest
    losses = {s["step"]: s["lm_loss"] for s in _strict(metrics)["steps"]}
    assert losses[4] is None  # strict JSON writes NaN as null
    for step in (2, 4):
        assert (save / f"iter_{step:07d}").exists() == (losses[step] is not None), losses
        if losses[step] is None:
            assert f" not saving iteration {step}: its lm loss is NaN/inf" in out


def test_fp16_on_cpu_that_skips_every_step_stops_unless_told(tmp_path):
    metrics = tmp_path / "metrics.json"
    code, out = run(*TINY, "--fp16", "--metrics-out", str(metrics))
    assert code == 3, out[-3000:]
    steps = _strict(metrics)["steps"]
    assert steps and all(s["skipped"] for s in steps)
    assert _strict(metrics)["summary"]["stopped"]["reason"] == "all-skipped"
    lines = _error_lines(out)
    assert (
        len(lines) == 1 and "skipped the update at every iteration of this run (1..4)" in (lines[0])
    ), out[-3000:]
    code, out = run(*TINY, "--fp16", "--no-divergence-stop")  # the opt-out
    assert code == 0 and " done: 4 steps" in out and "stopped:" not in out, out[-3000:]
    # a long run stops once the scaler is stuck at its floor, not after all its iterations: a
    # static scale of 2**32 (what the dynamic one starts from) cannot back off at all
    argv = list(TINY)
    argv[argv.index("--train-iters") + 1] = "200"
    code, out = run(*argv, "--fp16", "--loss-scale", str(2**32), "--metrics-out", str(metrics))
    assert code == 3, out[-3000:]
    data = _strict(metrics)
    assert data["summary"]["stopped"]["reason"] == "stuck-loss-scale", data["summary"]
    # --divergence-steps (5) consecutive skipped steps at the floor
    assert len(data["steps"]) == 5 and all(s["skipped"] for s in data["steps"]), data["steps"]
    assert "(1..5) at its smallest loss scale 4.29497e+09" in out, out[-3000:]


def test_resume_past_the_checkpoint_schedule_at_lr_0_stops(tmp_path, good_checkpoint):
    import shutil

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    shutil.copytree(good_checkpoint, ckpt)
    argv = list(TINY)
    argv[argv.index("--train-iters") + 1] = "8"
    code, out = run(
        *argv,
        "--load",
        str(ckpt),
        "--use-checkpoint-opt_param-scheduler",
        "--metrics-out",
        str(metrics),
    )
    assert code == 3, out[-3000:]
    data = _strict(metrics)
    assert [s["step"] for s in data["steps"]] == [5, 6, 7, 8]
    assert all(s["lr"] == 0.0 for s in data["steps"])
    assert data["summary"]["stopped"]["reason"] == "zero-lr"
    assert _error_lines(out) == [
        "megatron-npu train: stopped: the learning rate was 0 at every iteration of this run "
        "(5..8): it trained nothing; raise --lr; when resuming past the checkpoint's schedule, "
        "pass --override-opt_param-scheduler instead of --use-checkpoint-opt_param-scheduler; "
        "--no-divergence-stop lets such a run go on"
    ], out[-3000:]
