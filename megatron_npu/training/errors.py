"""The one error type a training run reports for bad input, and how it reaches the user once.

:class:`TrainingInputError` stands for every fault the user can fix: an option value, a data file,
a checkpoint file, a directory. Its message names the flag, file or field and says what to do;
the run then exits with status :data:`EXIT_STATUS` (2, argparse's) and prints no traceback.
(The class lives in :mod:`megatron_npu.data.errors`, so the data checks need not import this
package.)

Where it is raised decides who prints it:

* in the launcher process (argument checks and :mod:`.preflight`, before any rank starts): the
  launcher prints it once;
* in a rank started by the launcher: the rank writes it to ``$MEGATRON_NPU_ERROR_DIR/rank-N.txt``
  (:func:`report`) and exits 2 without printing; the launcher stops the other ranks and prints
  each distinct message once (:func:`collect`);
* in a rank started by torchrun (no error directory): the rank prints it itself, prefixed with
  its rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_npu.data.errors import TrainingInputError

__all__ = ["ERROR_DIR_ENV", "EXIT_STATUS", "PREFIX", "TrainingInputError", "collect", "report"]

#: Exit status of a run stopped by a :class:`TrainingInputError` (argparse uses 2 as well).
EXIT_STATUS = 2
#: Set by the launcher for its ranks: where a rank leaves its error message.
ERROR_DIR_ENV = "MEGATRON_NPU_ERROR_DIR"
PREFIX = "megatron-npu train: error: "


def report(exc: TrainingInputError) -> None:
    """Hand ``exc`` to whoever prints it: the launcher's error directory, else stderr."""
    rank = os.environ.get("RANK")
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir and rank is not None:
        path = Path(error_dir) / f"rank-{int(rank)}.txt"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(exc), encoding="utf-8")
        os.replace(tmp, path)  # the launcher never reads half a message
        return
    where = (
        f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    )
    print(f"{where}{PREFIX}{exc}", file=sys.stderr, flush=True)


def collect(error_dir: str | os.PathLike[str]) -> dict[str, list[int]]:
    """The distinct messages left in ``error_dir``, each with the ranks that reported it."""
    found: dict[str, list[int]] = {}
    directory = Path(error_dir)
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1])):
        found.setdefault(path.read_text(encoding="utf-8"), []).append(int(path.stem.split("-")[1]))
    return found
