"""Run one matrix entry as a ``megatron-npu train ... --metrics-out`` subprocess, cached by hash.

A run's folder ``<out>/runs/<name>/`` holds ``metrics.json`` (train's own), ``train.log`` (its
console output), ``run.json`` (compare's record: config hash, status, command, wall time, LAMBADA
result) and, with LAMBADA on, ``ckpt/`` (the final checkpoint, model weights only).

The config hash covers the resolved device, the exact train argv (minus paths inside the output
folder), the rerun index, and the megatron-npu / megatron-core / torch versions. A run whose
``run.json`` has the same hash and status ``ok`` and whose ``metrics.json`` is there is reused
("cached"), so re-running a matrix only runs what changed or failed.

Each rank runs with one host thread unless ``OMP_NUM_THREADS`` is set (:func:`run_environment`).
A run is killed (its whole process group) after ``timeout_s``; a non-zero exit or a kill is
recorded as ``failed`` with the reason and the log's tail, and the comparison goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_npu import console
from megatron_npu.compare.matrix import LAYOUT_OPTIONS, PERTURB_OPTIONS, RunSpec, option_argv
from megatron_npu.devices.facts import emulated
from megatron_npu.formats import FormatError
from megatron_npu.formats.lambada_result import LambadaResult
from megatron_npu.formats.run_record import RunRecord
from megatron_npu.training.weight_nudge import ENV as NUDGE_ENV
from megatron_npu.versions import library_versions

LOG_TAIL_LINES = 15


@dataclass
class Outcome:
    status: str  # ok | cached | failed
    error: str | None
    wall_s: float
    command: list[str]
    config_hash: str
    lambada: LambadaResult | None = None
    session: str | None = None  # the compare invocation that timed it (cached runs keep theirs)


def device_available(name: str) -> bool:
    """Whether runs on ``name`` can start here (:func:`megatron_npu.devices.available`)."""
    from megatron_npu import devices

    return devices.available(name)


def resolve_device(spec: RunSpec) -> str | None:
    return next((name for name in spec.devices if device_available(name)), None)


def uses_default_corpus(options: dict[str, Any]) -> bool:
    return not options.get("data-path") and not options.get("mock-data")


def train_command(
    spec: RunSpec, device: str, run_dir: Path, corpus_dir: Path, checkpoint: bool
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "megatron_npu.cli",
        "train",
        *option_argv(spec.options),
        "--device",
        device,
    ]
    if uses_default_corpus(spec.options) and "default-corpus-dir" not in spec.options:
        argv += ["--default-corpus-dir", str(corpus_dir)]
    argv += ["--metrics-out", str(run_dir / "metrics.json"), "--progress", "plain"]
    if checkpoint:
        argv += ["--save", str(run_dir / "ckpt"), "--no-save-optim", "--no-save-rng"]
    return argv


def perturbation_env(spec: RunSpec, device: str) -> dict[str, str]:
    """The environment a perturbed rerun changes. ``perturb = "threads"``: another OpenMP thread
    count than the runs' (:func:`run_environment`). On this host's oneDNN the GEMMs are bitwise
    the same for 1 and 2 threads; full reductions (loss means, norms) split differently, so it is
    the weaker of the rounding perturbations. Raises ValueError on a device whose arithmetic is
    not the host CPU's. ``init-ulp`` / ``init-ulp-down`` of a script run: the ulps
    ``run_script`` nudges the script's initial weights by (a train run takes them as an
    option)."""
    if spec.kind == "script" and spec.perturb in PERTURB_OPTIONS:
        return {NUDGE_ENV: str(PERTURB_OPTIONS[spec.perturb][1])}
    if spec.perturb != "threads":
        return {}
    from megatron_npu import devices

    if devices.make(device).torch_type != "cpu":
        raise ValueError(
            f'perturb = "threads" changes the host CPU\'s threads; {device} computes elsewhere: '
            "use init-ulp and init-ulp-down"
        )
    threads = int(run_environment()["OMP_NUM_THREADS"] or 1)
    return {"OMP_NUM_THREADS": str(2 if threads == 1 else 1)}


def recorded_command(command: list[str], env: dict[str, str]) -> list[str]:
    """The command as ``run.json`` keeps it: prefixed with ``env K=V ...`` when the run changed
    its environment (a perturbed rerun), so that the line reproduces the run as it ran."""
    if not env:
        return command
    return ["env", *(f"{k}={v}" for k, v in env.items()), *command]


def config_hash(
    spec: RunSpec,
    device: str,
    rerun_index: int,
    checkpoint: bool,
    env: dict[str, str] | None = None,
) -> str:
    versions = library_versions()
    identity = {
        "device": device,
        "options": option_argv(dict(sorted(spec.options.items()))),
        "rerun": rerun_index,
        "checkpoint": checkpoint,
        "versions": {
            k: versions.get(k) for k in ("megatron-npu", "megatron-core", "torch", "torch_npu")
        },
    }
    if env:
        identity["environment"] = env
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def read_record(path: Path) -> RunRecord | None:
    """The run's ``run.json``, or None when there is none or it does not fit its format (the run
    is then not reused)."""
    try:
        return RunRecord.read(path)
    except FormatError:
        return None


def _cached(spec: RunSpec, run_dir: Path, digest: str, command: list[str]) -> Outcome | None:
    """The outcome of an identical finished run in ``run_dir`` (its ``run.json`` has ``digest``
    and status ok, its ``metrics.json`` is there), said on the console; None when there is none."""
    cached = read_record(run_dir / "run.json")
    if not (
        cached
        and cached.config_hash == digest
        and cached.status == "ok"
        and (run_dir / "metrics.json").is_file()
    ):
        return None
    console.say(f" [compare] {spec.name}: cached (config {digest}), not run again")
    wall = float(cached.wall_s or 0.0)
    return Outcome("cached", None, wall, command, digest, cached.lambada, cached.session)


def _finished(
    record_path: Path,
    digest: str,
    error: str | None,
    wall: float,
    command: list[str],
    session: str | None,
) -> Outcome:
    """Record a run that ran (``run.json``) and return its outcome: failed with ``error``, else
    ok."""
    status = "failed" if error else "ok"
    RunRecord(
        config_hash=digest,
        status=status,
        error=error,
        wall_s=wall,
        command=command,
        session=session,
    ).write(record_path)
    return Outcome(status, error, wall, command, digest, session=session)


def run_environment() -> dict[str, str]:
    """The runs' environment: unbuffered output, and one host thread per rank unless
    ``OMP_NUM_THREADS`` is set (CPU rows then compare like with like, and OpenMP barriers do not
    stall on a loaded machine)."""
    return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}


def stream(
    command: list[str],
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> tuple[int | None, list[str], float]:
    """Run ``command`` in its own process group, copying its output to the console and ``log_path``.
    Returns (exit code or None if killed at the timeout, the log's last lines, seconds)."""
    tail: list[str] = []
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            env={**run_environment(), **(env or {})},
        )

        def pump() -> None:
            for line in proc.stdout:
                log.write(line)
                console.relay(line)
                tail.append(line.rstrip("\n"))
                del tail[:-LOG_TAIL_LINES]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and the ranks it launched
            proc.wait()
            code = None
        reader.join(timeout=10)
    return code, list(tail), time.perf_counter() - start


#: a line where a run says why it stopped: the adaptor's named refusal, or a Python exception
#: (a rank's, behind torchrun's ``[rankN]:`` prefix)
_STOP_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?"
    r"((?:megatron-npu[\w -]*: |[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b:?).*)$"
)
#: lines torchrun's elastic agent writes about a child's failure (its footer, its own traceback)
_LAUNCHER_LINE = re.compile(r"torch\.distributed\.elastic|ChildFailedError|To enable traceback")


def script_error(log: Path) -> str | None:
    """The last line in which the script (not torchrun) says why it stopped, rank prefix off."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        match = _STOP_LINE.match(line.strip())
        if match and not _LAUNCHER_LINE.search(line):
            found = match.group(1).strip()
    return found


def _failure(code: int | None, tail: list[str], timeout_s: float, log: Path | None = None) -> str:
    if code is None:
        reason = f"killed after the {timeout_s:g} s timeout"
    elif code < 0:
        reason = f"killed by signal {-code}"
    else:
        reason = f"exit code {code}"
    own = script_error(log) if log is not None else None
    if own:
        return f"{reason}: {own}"
    lines = [line.strip() for line in tail if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    shown = errors[-3:] or lines[-5:]
    return reason + (": " + " / ".join(shown) if shown else "")


def execute(
    spec: RunSpec,
    device: str,
    run_dir: Path,
    *,
    corpus_dir: Path,
    timeout_s: float,
    rerun_index: int = 0,
    checkpoint: bool = False,
    session: str | None = None,
) -> Outcome:
    """Train ``spec`` on ``device`` unless an identical finished run is cached in ``run_dir``."""
    command = train_command(spec, device, run_dir, corpus_dir, checkpoint)
    try:
        env = perturbation_env(spec, device)
    except ValueError as exc:
        return Outcome("failed", str(exc), 0.0, command, "")
    digest = config_hash(spec, device, rerun_index, checkpoint, env)
    record_path, metrics_path = run_dir / "run.json", run_dir / "metrics.json"
    recorded = recorded_command(command, env)
    cached = _cached(spec, run_dir, digest, recorded)
    if cached is not None:
        return cached
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (metrics_path, record_path):
        stale.unlink(missing_ok=True)
    shown = "".join(f"{k}={v} " for k, v in env.items())
    console.say(f" [compare] {spec.name}: {device} | {shown}{' '.join(command[3:])}")
    code, tail, wall = stream(command, run_dir / "train.log", timeout_s, env)
    ok = code == 0 and metrics_path.is_file()
    error = (
        None
        if ok
        else _failure(code, tail, timeout_s, run_dir / "train.log")
        if code != 0
        else "no metrics.json was written"
    )
    return _finished(record_path, digest, error, wall, recorded, session)


#: torchrun's single-node rendezvous: its store binds a port the system picks and tells the ranks
#: (torchrun's default, a fixed ``--master-port`` 29500, fails while another run holds it). How
#: the ranks meet changes no result, so a run's cache identity leaves it out.
RENDEZVOUS = "--standalone"


def script_command(spec: RunSpec, log_dir: Path | None = None) -> list[str]:
    """``torchrun --standalone --nproc-per-node N -m megatron_npu.run_script SCRIPT ARGS...``
    (torchrun as ``python -m torch.distributed.run``, so the interpreter is this one); with
    ``log_dir``, torchrun keeps its per-rank logs there instead of a ``torchelastic_*`` folder in
    /tmp."""
    logs = ["--log-dir", str(log_dir)] if log_dir is not None else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        RENDEZVOUS,
        "--nproc-per-node",
        str(spec.nproc_per_node),
        *logs,
        "-m",
        "megatron_npu.run_script",
        str(spec.path),
        *spec.script_args,
    ]


def script_environment(spec: RunSpec, device: str) -> dict[str, str]:
    """The environment of a script run (:func:`megatron_npu.run_script.environment`)."""
    from megatron_npu.run_script import environment

    return environment(str(spec.path), device)


def execute_script(
    spec: RunSpec,
    device: str,
    run_dir: Path,
    *,
    timeout_s: float,
    session: str | None = None,
) -> Outcome:
    """Run a user's Megatron-LM script through the adaptor (cached by hash like a train run) and
    turn its log into ``metrics.json`` (:mod:`.mlm_log`)."""
    from megatron_npu.compare import mlm_log

    script = Path(str(spec.path))
    bare = script_command(spec)
    launched = bare[3:]
    if RENDEZVOUS in launched:  # the first is the launcher's own, before the script's arguments
        launched.remove(RENDEZVOUS)
    try:
        perturbed = perturbation_env(spec, device)
    except ValueError as exc:
        return Outcome("failed", str(exc), 0.0, bare, "")
    identity = {
        "device": device,
        "command": launched,
        "versions": library_versions(),
        "script_sha256": hashlib.sha256(script.read_bytes()).hexdigest()
        if script.is_file()
        else None,
    }
    if perturbed:
        identity["environment"] = perturbed
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    command = script_command(spec, run_dir / "torchrun-logs")
    recorded = recorded_command(command, perturbed)
    record_path, metrics_path, log_path = (
        run_dir / "run.json",
        run_dir / "metrics.json",
        run_dir / "train.log",
    )
    cached = _cached(spec, run_dir, digest, recorded)
    if cached is not None:
        return replace(cached, lambada=None)  # a script run has no LAMBADA evaluation
    if not script.is_file():
        return Outcome("failed", f"no script {script}", 0.0, recorded, digest)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (metrics_path, record_path):
        stale.unlink(missing_ok=True)
    shown = "".join(f"{k}={v} " for k, v in perturbed.items())
    console.say(f" [compare] {spec.name}: {device} | {shown}{' '.join(command[3:])}")
    # an unperturbed run is never nudged, whatever the caller's environment holds
    env = {**script_environment(spec, device), NUDGE_ENV: "0", **perturbed}
    code, tail, wall = stream(command, log_path, timeout_s, env)
    error = _failure(code, tail, timeout_s, log_path) if code != 0 else None
    if error is None:
        try:
            metrics = mlm_log.to_metrics(mlm_log.parse(log_path), str(log_path))
        except mlm_log.LogFormatError as exc:
            error = f"its log cannot be read: {exc}"
        else:
            metrics.config.device = device
            metrics.config.device_emulated = emulated(device)
            metrics.write(metrics_path)
    return _finished(record_path, digest, error, wall, recorded, session)


def evaluation_options(spec: RunSpec) -> dict[str, Any]:
    """The run's options for a one-process TP1/PP1 evaluation of its checkpoint: layout options
    dropped, the vocabulary padded as the run padded it."""
    options = {k: v for k, v in spec.options.items() if k not in LAYOUT_OPTIONS}
    from megatron_npu.compare.matrix import DEFAULT_DIVISIBLE_BY

    divisible = int(spec.options.get("make-vocab-size-divisible-by", DEFAULT_DIVISIBLE_BY))
    options["make-vocab-size-divisible-by"] = divisible * spec.tensor_parallel
    return options


def evaluate_lambada(
    spec: RunSpec,
    device: str,
    run_dir: Path,
    data: str,
    *,
    timeout_s: float,
) -> tuple[dict[str, Any] | None, str | None]:
    """LAMBADA accuracy of the run's final checkpoint (one process), or (None, why not)."""
    out = run_dir / "lambada.json"
    out.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "megatron_npu.cli",
        "evaluate",
        "--task",
        "lambada",
        "--load",
        str(run_dir / "ckpt"),
        "--valid-data",
        data,
        "--device",
        device,
        "--results-out",
        str(out),
        *option_argv(evaluation_options(spec)),
    ]
    console.say(f" [compare] {spec.name}: LAMBADA on its final checkpoint")
    code, tail, _ = stream(command, run_dir / "evaluate.log", timeout_s)
    if code != 0:
        return None, _failure(code, tail, timeout_s)
    try:
        result = LambadaResult.read(out)
    except FormatError as exc:
        return None, f"its lambada.json cannot be used: {exc}"
    record = read_record(run_dir / "run.json")
    if record is not None:  # a record that does not fit is left as it is, not replaced
        record.lambada = result
        record.write(run_dir / "run.json")
    return result, None
