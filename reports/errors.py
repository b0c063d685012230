"""What can go wrong with a report's inputs, and how a partial input is described."""

from __future__ import annotations

from dataclasses import dataclass


class ReportInputError(ValueError):
    """An input the report cannot use at all (a path that does not exist); names the path."""


@dataclass(frozen=True)
class Skipped:
    """One input (or part of one) left out of the report, and why; the page lists every one."""

    source: str
    reason: str
