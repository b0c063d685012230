"""How every megatron-npu command speaks: Python logging, rendered by rich.

Each line a command prints is a record of the ``megatron_npu.console`` logger. One handler
renders the records on two rich consoles: INFO lines on standard output, WARNING and ERROR lines on
standard error. The lines come out as written: no markup, highlighting, emoji or wrapping, so a
script or a test that reads them sees the words the code wrote, whatever the terminal's width. A
user who wants fewer lines sets the logger's level
(``logging.getLogger("megatron_npu.console").setLevel(...)``). The package's other loggers
(``megatron_npu.patches...``) are left as they are: they go to the root logger's handlers.

* :func:`say`, :func:`warn`, :func:`error` -- one line each, at INFO, WARNING, ERROR.
* :func:`stdout` -- the standard-output console the lines are said on; the training progress bar
  draws on it too, so lines said while the bar is live are printed above it. While a bar is live
  (:func:`bar_live`) warnings and errors are said there as well: written to standard error
  they would tear the bar's lines apart.
* :func:`tables` -- a console for the rich tables of ``info`` and ``parity``: at least
  :data:`TABLE_WIDTH` columns, because a pipe or a log file has no width of its own and a table
  folded at 80 columns cannot be read.
* :func:`relay` -- another process's output (a training run that compare or locate started), copied
  as it arrives. It is that process's own text, already formatted, so it is not a record here.

The consoles look up ``sys.stdout``/``sys.stderr`` when they write, not when they are made, so a
redirected stream (pytest's capture, ``contextlib.redirect_stdout``) receives the lines.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from rich.console import Console

LOGGER_NAME = "megatron_npu.console"

_PLAIN = {"markup": False, "highlight": False, "emoji": False, "soft_wrap": True}

_out = Console(soft_wrap=True, highlight=False, emoji=False)
_err = Console(stderr=True, soft_wrap=True, highlight=False, emoji=False)


#: the narrowest a table is laid out
TABLE_WIDTH = 160


def stdout() -> Console:
    """The standard-output console (lines, the progress bar)."""
    return _out


def tables(file: TextIO | None = None) -> Console:
    """A console for rich tables on ``file`` (standard output when None), with markup."""
    return Console(file=file, width=max(TABLE_WIDTH, _out.width), highlight=False, emoji=False)


_live_bars = 0


def bar_live(live: bool) -> None:
    """A progress bar on :func:`stdout` started (True) or stopped (False)."""
    global _live_bars
    _live_bars = max(0, _live_bars + (1 if live else -1))


class RichLineHandler(logging.Handler):
    """Renders each record as one plain line: below WARNING on stdout, the rest on stderr (on
    stdout too while a progress bar is live)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            console = _err if record.levelno >= logging.WARNING and not _live_bars else _out
            console.print(self.format(record), **_PLAIN)
        except Exception:  # a closed stream must not take the command down with it
            self.handleError(record)


def _logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, RichLineHandler) for h in logger.handlers):
        logger.addHandler(RichLineHandler())
        logger.setLevel(logging.INFO)
        # Megatron-LM configures the root logger; the lines are said once, by this handler.
        logger.propagate = False
    return logger


LOG = _logger()


def say(line: str) -> None:
    """One line of what a command is doing or found, on standard output."""
    LOG.info("%s", line)


def warn(line: str) -> None:
    """One line the user should act on but that does not stop the command, on standard error."""
    LOG.warning("%s", line)


def error(line: str) -> None:
    """The one named line a failing command ends with, on standard error."""
    LOG.error("%s", line)


def relay(text: str) -> None:
    """Copy another process's output to standard output as it arrives."""
    sys.stdout.write(text)
    sys.stdout.flush()
