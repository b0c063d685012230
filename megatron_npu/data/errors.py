"""The one error type for a fault the user can fix (an option, a data file, a checkpoint).

It lives here, at the bottom of the package graph, so that the data pipeline's checks
(:mod:`.index_check`) raise it without importing the training package;
:mod:`megatron_npu.training.errors` re-exports it and says how a run reports it (exit status 2,
one line, no traceback).
"""

from __future__ import annotations


class TrainingInputError(Exception):
    """A fault in what the user gave the run. ``message`` names the flag, file or field;
    ``remedy`` (optional) says how to fix it."""

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        return self.message if not self.remedy else f"{self.message}; {self.remedy}"
