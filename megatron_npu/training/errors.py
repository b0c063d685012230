"""The named errors a training run reports, and how each reaches the user once.

:class:`TrainingInputError` stands for every fault the user can fix: an option value, a data file,
a checkpoint file, a directory. Its message names the flag, file or field and says what to do;
the run then exits with status :data:`EXIT_STATUS` (2, argparse's) and prints no traceback.
(The class lives in :mod:`megatron_npu.data.errors`, so the data checks need not import this
package.)

:class:`TrainingStopped` stands for a run that trains nothing useful although its input was
accepted (:mod:`.divergence`: a NaN/inf loss, every step skipped, a zero learning rate); it
exits with :data:`STOPPED_EXIT_STATUS` (3) and is reported the same way, as
``megatron-npu train: stopped: ...``.

Where it is raised decides who prints it:

* in the launcher process (argument checks and :mod:`.preflight`, before any rank starts): the
  launcher prints it once;
* in a rank started by the launcher: the rank writes it to the error file torch elastic gives
  each rank it starts (``$TORCHELASTIC_ERROR_FILE``, in elastic's own format) and exits 2
  without printing; the launcher stops the other ranks and prints each distinct message once
  (:func:`collect`);
* in a rank started by torchrun: the rank prints it itself, prefixed with its rank, and writes
  the same error file, so torchrun's failure summary carries the named line too.
"""

from __future__ import annotations

import json
import os
import time

from megatron_npu import console
from megatron_npu.data.errors import TrainingInputError
from megatron_npu.files import write_private

__all__ = [
    "ERROR_FILE_ENV",
    "EXIT_STATUS",
    "LAUNCHER_PID_ENV",
    "PREFIX",
    "STOPPED_EXIT_STATUS",
    "STOPPED_PREFIX",
    "TrainingInputError",
    "TrainingStopped",
    "collect",
    "exit_status",
    "port_in_use",
    "report",
]

#: Exit status of a run stopped by a :class:`TrainingInputError` (argparse uses 2 as well).
EXIT_STATUS = 2
#: torch elastic's: the file a rank it started writes its failure to (torchrun sets it too).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: Set by megatron-npu's launcher for its ranks: its process id (a rank of it prints nothing of
#: its own failure; the launcher says it once).
LAUNCHER_PID_ENV = "MEGATRON_NPU_LAUNCHER_PID"
#: what a command's error line starts with (``train``'s: :data:`PREFIX`)
ERROR_PREFIX = "megatron-npu {command}: error: "
PREFIX = ERROR_PREFIX.format(command="train")
#: Exit status of a run stopped by a :class:`TrainingStopped` (diverged / trains nothing).
STOPPED_EXIT_STATUS = 3
STOPPED_PREFIX = "megatron-npu train: stopped: "


class TrainingStopped(Exception):
    """The run was stopped because it trains nothing useful. ``reason`` is a short code
    (recorded in the metrics file), ``message`` says what happened, ``remedy`` what to do."""

    def __init__(self, reason: str, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        return self.message if not self.remedy else f"{self.message}; {self.remedy}"


def port_in_use(port: int, given: bool = True) -> TrainingInputError:
    """The error for a ``--master-port`` another program listens on (preflight's check and the
    launcher's bind say the same); ``given=False``: the multi-node default port, which the user
    did not give."""
    if not given:
        return TrainingInputError(
            f"the default --master-port {port} is already in use on this machine (another "
            "run, or another program, listens on it)",
            "give every node the same free --master-port",
        )
    return TrainingInputError(
        f"--master-port {port} is already in use on this machine (another run, or another "
        "program, listens on it)",
        "give another --master-port, or leave it out to take a free one",
    )


def _line(exc: TrainingInputError | TrainingStopped, command: str = "train") -> str:
    if isinstance(exc, TrainingStopped):
        return f"{STOPPED_PREFIX}{exc}"
    return f"{ERROR_PREFIX.format(command=command)}{exc}"


def exit_status(exc: TrainingInputError | TrainingStopped) -> int:
    return STOPPED_EXIT_STATUS if isinstance(exc, TrainingStopped) else EXIT_STATUS


def report(exc: TrainingInputError | TrainingStopped, command: str = "train") -> int:
    """Hand ``exc`` to whoever prints it as one whole line (the launcher, through the rank's
    error file; else stderr), named as ``megatron-npu <command>``'s; returns the exit status the
    run ends with."""
    rank = os.environ.get("RANK")
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file and rank is not None:
        try:  # torch elastic's format: what its ProcessFailure and torchrun's summary read;
            # written whole or not at all (a rank stopped while writing leaves no half file)
            write_private(
                error_file,
                json.dumps({"message": _line(exc, command), "timestamp": int(time.time())}),
            )
            if os.environ.get(LAUNCHER_PID_ENV):
                return exit_status(exc)
        except OSError:
            pass  # no launcher to read it: print it instead
    where = (
        f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    )
    console.error(f"{where}{_line(exc, command)}")
    return exit_status(exc)


def _read(path: str) -> str:
    """The message of an error file (torch elastic's format; ``@record`` nests it), or ''."""
    try:
        with open(path, encoding="utf-8") as handle:
            message = json.load(handle).get("message", "")
    except (OSError, ValueError, AttributeError):
        return ""
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip()


def collect(files: dict[int, str], ranks: list[int] | None = None) -> dict[str, list[int]]:
    """The distinct lines the ranks left in their error files (rank -> path), each with the
    ranks that reported it; ``ranks`` first, in that order, when given (the ranks that
    failed)."""
    found: dict[str, list[int]] = {}
    order = [r for r in (ranks or []) if r in files] + sorted(set(files) - set(ranks or []))
    for rank in order:
        line = _read(files[rank])
        if line:
            found.setdefault(line, []).append(rank)
    for reporters in found.values():
        reporters.sort()
    return found
