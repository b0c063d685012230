"""``run.json``: compare's record of one run it trained or ran (``<out>/runs/<name>/run.json``).

A later compare reuses the run ("cached") when the record's ``config_hash`` is the one the run
would have now, its ``status`` is ``ok`` and the run's ``metrics.json`` is there; ``locate``
takes a compare run's command from it. Every field may be absent: records of older versions
lack ``session`` and ``lambada``, and a record of an unknown shape only means the run is not
reused.
"""

from __future__ import annotations

from pydantic import Field

from megatron_npu.formats.base import Document, Number
from megatron_npu.formats.lambada_result import LambadaResult

#: what a run's recorded command is (``run.json`` and compare's results alike)
COMMAND_DESCRIPTION = (
    "the exact argv; a perturbed rerun's starts with `env K=V ...`, the environment it changed"
)


class RunRecord(Document):
    """Compare's record of one run: what ran, how it ended, and the cache key."""

    schema_name = "run-record"

    config_hash: str | None = Field(
        None,
        description="16 hex digits of the run's identity: a train run's device, exact argv, "
        "rerun index, checkpointing, environment changes and library versions; a script run's "
        "device, command, library versions and the script's SHA-256",
    )
    status: str | None = Field(None, description="ok or failed")
    error: str | None = Field(
        None,
        description="for failed: exit code / signal / timeout and why the run stopped (its own "
        "last error line, else the log's last lines)",
    )
    wall_s: Number | None = Field(None, description="wall seconds of the run's subprocess")
    command: list[str] | None = Field(
        None,
        description=COMMAND_DESCRIPTION,
    )
    session: str | None = Field(
        None,
        description="the compare invocation that timed the run: speed verdicts only compare runs "
        "timed in the same one",
    )
    lambada: LambadaResult | None = Field(
        None,
        description="the LAMBADA evaluation of the run's final checkpoint ([compare] lambada = "
        "true), added when it finished",
    )


DOCUMENTS = (RunRecord,)
