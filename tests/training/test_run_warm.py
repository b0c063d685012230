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
