"""The one options model of train's options (megatron_npu.training.options): the command line it
gives back parses to the same options for every option train has; the sections cover every
option once; bad input is an ArgumentError naming it, never a SystemExit."""

from __future__ import annotations

import argparse

import pytest

from megatron_npu.training import arguments
from megatron_npu.training.options import SECTIONS, TrainOptions

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --mock-data "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 2"
).split()


def _parser(command: str) -> argparse.ArgumentParser:
    parser = arguments.build_parser(command)

    def refuse(message):
        raise arguments.ArgumentError(message)

    parser.error = refuse
    return parser


def _base(command: str) -> list[str]:
    return [*TINY, "--task", "lambada"] if command == "evaluate" else list(TINY)


def _other_value(
    parser: argparse.ArgumentParser, action: argparse.Action, base: list[str]
) -> list[str]:
    """Tokens that give ``action`` a value other than its default."""
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if action.nargs == 0:
        return [flag]  # store_true/false, and a BooleanOptionalAction's positive form
    candidates = [str(c) for c in (action.choices or ())] + ["3", "0.25", "x.bin"]
    count = {None: 1, "?": 1, "+": 2}.get(action.nargs, action.nargs)
    for value in candidates:
        tokens = [flag, *[value] * count]
        try:
            parsed = parser.parse_args([*base, *tokens])
        except arguments.ArgumentError:
            continue
        if getattr(parsed, action.dest) != action.default:
            return tokens
    raise AssertionError(f"no other value found for {flag}")


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_the_command_line_given_back_parses_to_the_same_options(command):
    """Every option of the command, one at a time off its default: argv() reads back equal."""
    parser = _parser(command)
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 100
    base = _base(command)
    for action in actions:
        if action.choices is not None and list(action.choices) == [action.default]:
            continue  # one value only (--ckpt-format torch_dist): never off its default
        given = parser.parse_args([*base, *_other_value(parser, action, base)])
        options = TrainOptions(command, given, given)
        line = options.argv()
        assert parser.parse_args(line) == given, (action.dest, line)
        if not set(action.option_strings) & set(base):  # left out: back to its default
            shorter = parser.parse_args(options.argv(without=[action.dest]))
            assert getattr(shorter, action.dest) == action.default, action.dest


def test_parse_checks_and_keeps_what_was_given():
    options = TrainOptions.parse(
        [*TINY, "--device", "cpu", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]
    )
    assert options.args.ffn_hidden_size == 256  # check() derived it
    assert options.given.ffn_hidden_size is None  # as given
    assert "--ffn-hidden-size" not in options.argv()  # so a replay derives it again
    assert options.world_size == 2
    assert options.parallel.tensor_model_parallel_size == 2
    assert options.model.num_layers == 2 and options.launch.device == "cpu"
    assert options.optimizer.lr == 1e-3 and options.run.train_iters == 2
    assert options.data.mock_data and options.checkpoint.save is None
    assert options.argv(without=["--nproc-per-node", "device"])[:2] == [
        "--tensor-model-parallel-size",
        "2",
    ]


def test_the_sections_hold_every_option_once():
    options = TrainOptions.parse(TINY)
    held: list[str] = []
    for name in SECTIONS:
        section = vars(options.section(name))
        assert section, name
        held += section
    parser = _parser("train")
    every = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert sorted(held) == sorted(every)
    with pytest.raises(AttributeError):
        options.optimiser  # noqa: B018


def test_the_disabled_patches_are_read_before_trains_parser():
    options = TrainOptions.parse([*TINY, "--disable-patch", "norm.wrapped-torch-norm"])
    assert options.disabled == ("norm.wrapped-torch-norm",)
    assert "--disable-patch" not in options.argv()


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--hiden-size", "64"], "unrecognized arguments: --hiden-size 64"),
        (["--lr", "fast"], "argument --lr: must be a number, got 'fast'"),
        (["--save-interval", "2"], "--save-interval needs --save"),
        (["--disable-patch", "no.such-patch"], "no.such-patch"),
    ],
)
def test_bad_options_are_an_argument_error(extra, words):
    with pytest.raises(arguments.ArgumentError, match=words.replace(".", r"\.")):
        TrainOptions.parse([*TINY, *extra])


def test_an_option_kind_argv_cannot_write_back_is_refused(monkeypatch):
    """A future option of a kind argv() has no form for fails loudly, never writes a wrong line."""
    import megatron_npu.training.options as options_module

    parser = _parser("train")
    parser.add_argument("--tag", action="append")
    monkeypatch.setitem(options_module._parsers, "train", parser)
    given = parser.parse_args([*TINY, "--tag", "a"])
    with pytest.raises(TypeError, match="--tag: TrainOptions.argv cannot write a _AppendAction"):
        TrainOptions("train", given, given).argv()
