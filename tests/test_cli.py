"""The ``megatron-npu`` command line: an option a command does not know is named by that
command, under that command's usage (argparse's own top-level reading names the program and
prints the list of commands instead)."""

from __future__ import annotations

import pytest

from megatron_npu import cli


@pytest.mark.parametrize(
    "command",
    [
        ["info"],
        ["parity"],
        ["compare"],
        ["report", "results"],
        ["locate", "--out", "out"],
        ["preprocess", "--input", "a", "--output-prefix", "b", "--tokenizer-type", "ByteLevel"],
    ],
    ids=lambda command: command[0],
)
def test_an_unknown_option_is_named_by_its_command(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--no-such-option"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"usage: megatron-npu {command[0]} "), lines
    assert lines[-1] == (
        f"megatron-npu {command[0]}: error: unrecognized arguments: --no-such-option"
    ), lines
