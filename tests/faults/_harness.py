"""Shared pieces of the fault-injection tests: the tiny model, a valid indexed dataset writer,
runs of ``python -m megatron_npu.train`` and the orphan check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from megatron_npu.data.tokenizers import null_vocab_size_for

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300

#: The smallest model a real run trains here (fp32, no dropout: resumes into another DP size
#: are exact; 4 iterations, global batch 4; 256 token ids, EOD included).
TINY = [
    "--device",
    "cpu",
    "--layout-independent-init",
    "--mock-data",
    "--vocab-size",
    str(null_vocab_size_for(256)),
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--train-iters",
    "4",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--progress",
    "plain",
]


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(extra or {})}
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "MEGATRON_NPU_DEVICE",
        "MEGATRON_NPU_PREFLIGHT_DONE",
        "TORCHELASTIC_ERROR_FILE",
        "MEGATRON_NPU_LAUNCHER_PID",
        "MEGATRON_NPU_RUN_ID",
    ):
        env.pop(key, None)
    return env


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_npu.train", *args],
        cwd=REPO,
        env=run_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = start(*args, env=env)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, out


def wait_for_line(proc: subprocess.Popen, needle: str, lines: list[str]) -> None:
    """Read ``proc``'s output into ``lines`` until a line contains ``needle``."""
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return
    raise AssertionError(f"{needle!r} never printed:\n{''.join(lines)[-4000:]}")


def processes_mentioning(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (this run's private path)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry}/stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def assert_no_orphans(marker: str, deadline_s: float = 30.0) -> None:
    """No process of the run is left (the kernel delivers parent-death signals at once; the
    deadline only absorbs a loaded machine)."""
    end = time.monotonic() + deadline_s
    while (left := processes_mentioning(marker)) and time.monotonic() < end:
        time.sleep(0.2)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the run: {left}"


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...), found through /proc."""
    parents = {int(e): _parent(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [child for child, parent in parents.items() if parent == pid]
        found += kids
        todo += kids
    return found


def alive(pids: list[int], deadline_s: float = 30.0) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone) after at most ``deadline_s``."""

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
        except OSError:
            return False

    end = time.monotonic() + deadline_s
    while (left := [p for p in pids if running(p)]) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def write_indexed_dataset(prefix: Path, documents: int = 6, length: int = 40) -> Path:
    """A valid Megatron indexed dataset (uint16 tokens, one sequence per document), written
    independently of Megatron's builder."""
    rng = np.random.default_rng(0)
    sizes = np.full(documents, length, dtype=np.int32)
    tokens = rng.integers(0, 250, size=documents * length, dtype=np.uint16)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)]).astype(np.int64)
    doc_idx = np.arange(documents + 1, dtype=np.int64)
    Path(f"{prefix}.bin").write_bytes(tokens.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(np.array([1], dtype="<u8").tobytes())
        f.write(np.array([8], dtype="<u1").tobytes())
        f.write(np.array([documents, documents + 1], dtype="<u8").tobytes())
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    return prefix
