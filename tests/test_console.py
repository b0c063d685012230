"""The commands' one way to speak (megatron_npu.console): which stream each line goes to, that a
line comes out as written whatever its length or brackets, that the logger's level silences it,
and that the tables are laid out wide."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys

from rich.table import Table

from megatron_npu import console


def test_lines_go_to_their_streams(capsys):
    console.say("a finding")
    console.warn("a warning")
    console.error("megatron-npu x: the named error")
    out, err = capsys.readouterr()
    assert out == "a finding\n"
    assert err == "a warning\nmegatron-npu x: the named error\n"


def test_a_line_comes_out_as_written(capsys):
    """No wrapping at the 80 columns of a pipe, no markup, highlighting or emoji."""
    line = " [compare] run: " + "x" * 150 + " [bold]kept[/bold] :smile: 1.5e-3 None /a/b"
    console.say(line)
    console.say("\n two lines, the first one empty")
    assert capsys.readouterr().out == line + "\n\n two lines, the first one empty\n"


def test_a_redirected_stdout_receives_the_lines():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        console.say("into the buffer")
    assert buffer.getvalue() == "into the buffer\n"


def test_the_logger_level_silences_lines(capsys):
    logger = logging.getLogger(console.LOGGER_NAME)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        console.say("hidden")
        console.warn("hidden too")
        console.error("shown")
    finally:
        logger.setLevel(before)
    out, err = capsys.readouterr()
    assert (out, err) == ("", "shown\n")


def test_lines_are_said_once_when_the_root_logger_has_handlers(capsys):
    """Megatron-LM configures the root logger; a line must not come out twice."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    root.addHandler(handler)
    try:
        console.say("once")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().out == "once\n"


def test_tables_are_laid_out_wide():
    buffer = io.StringIO()
    table = Table()
    table.add_column("name")
    table.add_column("detail")
    table.add_row("a-patch-id", "d" * 120)
    console.tables(buffer).print(table)
    rows = buffer.getvalue().splitlines()
    assert any("d" * 120 in row for row in rows)  # not folded at 80 columns
    assert max(map(len, rows)) <= console.TABLE_WIDTH


def test_a_command_in_a_pipe_prints_unwrapped_lines():
    """A subprocess whose stdout is a pipe (no terminal width): the lines are whole."""
    code = "from megatron_npu import console; console.say('y' * 200); console.error('e' * 120)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "y" * 200 + "\n"
    assert done.stderr == "e" * 120 + "\n"


def test_the_packages_other_loggers_are_left_to_the_root_handlers(capsys):
    """Only the console's own logger has the handler: a module logger's INFO record (silent
    under the root's default WARNING level) prints nothing, and its records still reach the
    root logger's handlers (a user's log file)."""
    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            caught.append(record.getMessage())

    root = logging.getLogger()
    handler = Catch()
    root.addHandler(handler)
    try:
        logging.getLogger("megatron_npu.patches.data").info("quiet detail")
        logging.getLogger("megatron_npu.patches.data").warning("a module warning")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr() == ("", "")
    assert caught == ["a module warning"]


def test_warnings_go_above_a_live_progress_bar(capsys):
    """On stderr a warning would tear a live bar's lines apart: while one is live it is said on
    the bar's console, then on stderr again."""
    console.bar_live(True)
    try:
        console.warn("while the bar runs")
    finally:
        console.bar_live(False)
    console.warn("after it")
    out, err = capsys.readouterr()
    assert (out, err) == ("while the bar runs\n", "after it\n")
