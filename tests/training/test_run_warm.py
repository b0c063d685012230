"""``launch.run_warm``: ranks forked from the warm fork server behave as freshly started ones --
torchrun's environment, their output in the log, the first failure stopping the others, and
what a process does at start-up done under the environment of the call that asks for ranks."""

from __future__ import annotations

import argparse
import builtins
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_npu.training import main_guard
from megatron_npu.training.launch import RankFailure, launch, run_warm

pytestmark = pytest.mark.multiprocess

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WARM_TEST_MARK",
)


def _report(out: str) -> None:
    rank = os.environ.get("RANK", "0")
    record = {
        "env": {k: os.environ.get(k) for k in KEYS},
        "start_method": multiprocessing.get_start_method(),
        "marker": getattr(builtins, "_warm_test_marker", None),
        "port_held": _held(os.environ["MASTER_PORT"]),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    print(f"rank {rank} reporting")


def _held(port: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", int(port)))
        except OSError:
            return True
    return False


def _rank_one_fails(_payload: None) -> None:
    if os.environ.get("RANK") == "1":
        raise ValueError("rank one refuses this payload")
    time.sleep(120)  # rank 0 would still be here: the launcher must not wait for it


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KEYS and k != "PYTHONPATH"}
    return {**env, **extra}


def test_ranks_get_torchrun_environment_and_their_output_is_logged(tmp_path):
    log = tmp_path / "ranks.log"
    run_warm(_report, str(tmp_path), 2, log=log, env=_env())
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        env = record["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"]
    # the caller holds the rendezvous port before any rank starts: no program can take it
    # between its choice and a rank's listen
    assert records[0]["port_held"] and records[1]["port_held"]
    text = log.read_text()
    assert "rank 0 reporting" in text and "rank 1 reporting" in text


def test_a_rank_starts_its_own_processes_as_a_fresh_process_does(tmp_path):
    """A rank's data-loader workers start as under torchrun (Python's default start method),
    not through a second fork server that imports the rank's main module anew."""
    fresh = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    run_warm(_report, str(tmp_path), 1, env=_env())
    assert json.loads((tmp_path / "rank0.json").read_text())["start_method"] == fresh


def test_the_first_failing_rank_stops_the_others_and_is_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exited with status 1") as failure:
        run_warm(_rank_one_fails, None, 2, env=_env())
    assert "ValueError: rank one refuses this payload" in str(failure.value)
    assert time.monotonic() - start < 100  # rank 0 was killed, not waited for


def test_start_up_runs_under_the_environment_of_each_call(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import builtins, os\nbuiltins._warm_test_marker = os.environ.get('WARM_TEST_MARK')\n"
    )
    seen = []
    for env in (
        _env(PYTHONPATH=str(site), WARM_TEST_MARK="a"),
        _env(PYTHONPATH=str(site), WARM_TEST_MARK="b"),
        _env(),
    ):
        out = tmp_path / f"run{len(seen)}"
        out.mkdir()
        run_warm(_report, str(out), 1, env=env)
        seen.append(json.loads((out / "rank0.json").read_text())["marker"])
    assert seen == ["a", "b", None]


def test_the_launcher_holds_the_rendezvous_port_before_its_ranks_start():
    args = argparse.Namespace(
        master_port=None,
        master_addr="127.0.0.1",
        nnodes=1,
        nproc_per_node=2,
        node_rank=0,
        distributed_timeout_minutes=1,
    )
    # each rank exits 0 only if the port it is told to meet on is already listened on
    assert launch([], args, module="tests.training._port_probe") == 0


_LOCATE_CALL = """import sys
from megatron_npu import cli
code = cli.main([
    "locate", "--step", "1", "--out", "out",
    "--reference", "--device cpu", "--candidate", "--device npu-emulated",
    "--common", "--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
    "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 --train-iters 1 "
    "--lr 1e-4 --vocab-size 64",
])
sys.exit(code)
"""


@pytest.mark.parametrize("guarded", [False, True], ids=["top-level", "guarded"])
def test_a_users_script_that_starts_ranks_outside_its_main_guard_gets_one_named_error(
    tmp_path, guarded
):
    """A rank from the fork server imports the caller's main module first; a call at its top
    level outside ``if __name__ == "__main__":`` would run again in every rank, each stopping
    with multiprocessing's own traceback. locate names the line once instead, before any rank
    starts; under the guard the same call replays both runs."""
    script = tmp_path / "user_locate.py"
    if guarded:
        body = "".join(f"    {line}\n" for line in _LOCATE_CALL.splitlines())
        script.write_text(f"if __name__ == '__main__':\n{body}")
    else:
        script.write_text(_LOCATE_CALL)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    if guarded:
        assert run.returncode == 0, run.stderr
        assert (tmp_path / "out" / "locate.json").is_file()
        return
    assert run.returncode == 2, run.stderr
    assert not (tmp_path / "out" / "locate.json").exists()
    assert [line for line in run.stderr.splitlines() if line.strip()] == [
        f"megatron-npu locate: the ranks start from a fork server and each first imports the "
        f"main module {script}, whose line 3 runs this call outside "
        '`if __name__ == "__main__":`, so every rank would run it again: put the call under '
        "that guard (Python's rule for multiprocessing's fork-server and spawn start methods)"
    ], run.stderr


def test_the_guard_is_recognised_as_python_programs_write_it():
    source = (
        "import x\n"  # 1
        "if '__main__' == __name__:\n"  # 2
        "    x.go()\n"  # 3
        "try:\n"  # 4
        "    if __name__ == '__main__':\n"  # 5
        "        x.go()\n"  # 6
        "        x.stop()\n"  # 7
        "except ImportError:\n"  # 8
        "    pass\n"  # 9
        "if __name__ != '__main__':\n"  # 10
        "    x.go()\n"  # 11
        "if __name__ == '__mp_main__' or x:\n"  # 12
        "    x.go()\n"  # 13
        "if __name__ != '__main__':\n"  # 14
        "    pass\n"  # 15
        "else:\n"  # 16
        "    x.go()\n"  # 17
        "if __name__ == '__main__' and x.ready:\n"  # 18
        "    x.go()\n"  # 19
        "if __name__ == '__main__' or x.ready:\n"  # 20
        "    x.go()\n"  # 21
    )
    covered = {line for span in main_guard._guarded_lines(source) for line in span}
    assert covered == {3, 6, 7, 17, 19}
