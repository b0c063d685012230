"""One options model for everything that takes train's options: ``megatron-npu train`` and
``evaluate``, the two runs ``locate`` compares, the runs a ``compare`` matrix trains.

:meth:`TrainOptions.parse` reads a command line with train's own parser
(:func:`.arguments.build_parser`, the one definition of every option) and checks it
(:func:`.arguments.check`); a bad option raises :class:`.arguments.ArgumentError` with argparse's
words. The result holds

* ``args``: the checked namespace, derived values filled in (what a rank session reads);
* the same options in sections, as the parser's help groups them: ``launch``, ``parallel``,
  ``model``, ``recompute``, ``mla``, ``moe``, ``fusions``, ``attention``, ``precision``,
  ``run`` (batch, iterations, seed, divergence stop), ``optimizer``, ``data``, ``checkpoint``,
  ``logging``, ``profiling`` (train only) (``options.parallel.tensor_model_parallel_size``,
  ``options.optimizer.lr``);
* ``disabled``: the patches ``--disable-patch`` switches off (a switch of every command, read
  before train's parser);
* :meth:`TrainOptions.argv`: the options as a command line that parses back to the same
  namespace -- each option given a value other than its default, in the parser's order,
  optionally without some of them: what a replay carries across a process boundary.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NoReturn

from megatron_npu.training import arguments

#: section name -> the start of the parser group's title it holds
SECTIONS = {
    "launch": "device and launch",
    "parallel": "parallelism",
    "model": "model",
    "recompute": "activation recomputation",
    "mla": "multi-latent attention",
    "moe": "mixture of experts",
    "fusions": "fusions",
    "attention": "fused attention",
    "precision": "mixed precision",
    "run": "run",
    "optimizer": "optimizer",
    "data": "data",
    "checkpoint": "checkpointing",
    "logging": "logging",
    "profiling": "profiling",
}


def _options_of(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


#: the action kinds train's parser uses, the ones :func:`_tokens` can write back
_WRITABLE = (
    argparse._StoreAction,
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse.BooleanOptionalAction,
)


def _tokens(action: argparse.Action, value: Any) -> list[str]:
    """``value`` of ``action`` as the tokens that parse back to it."""
    if not isinstance(action, _WRITABLE) or action.nargs == "?":
        raise TypeError(
            f"{_options_of(action)}: TrainOptions.argv cannot write a {type(action).__name__}"
            f"{' with nargs=?' if action.nargs == '?' else ''} back as a command line"
        )
    if isinstance(action, argparse.BooleanOptionalAction):
        long = [s for s in action.option_strings if s.startswith("--")]
        return [next(s for s in long if s.startswith("--no-") == (not value))]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [_options_of(action)]
    if isinstance(value, (list, tuple)):
        return [_options_of(action), *(str(v) for v in value)]
    return [_options_of(action), str(value)]


@dataclass(frozen=True)
class TrainOptions:
    """A command's train options, parsed and checked once (module docstring)."""

    command: str
    args: argparse.Namespace
    given: argparse.Namespace = field(repr=False)  # as parsed, before the checks derive values
    disabled: tuple[str, ...] = ()

    @classmethod
    def parse(cls, argv: Sequence[str], command: str = "train") -> TrainOptions:
        from megatron_npu.disable_patch_option import add_disable_patch_argument

        switch = argparse.ArgumentParser(add_help=False)
        add_disable_patch_argument(switch)
        switch.error = _refuse  # type: ignore[method-assign]
        switches, rest = switch.parse_known_args(list(argv))
        parser = _parser(command)
        given = parser.parse_args(rest)
        args = copy.deepcopy(given)
        arguments.check(args)
        return cls(command, args, given, tuple(switches.disable_patch or ()))

    def argv(self, without: Iterable[str] = ()) -> list[str]:
        """The options given a value other than their default, as train reads them, without
        the options named in ``without`` (``"--save"`` or the destination ``"save"``)."""
        left_out = {name.removeprefix("--").replace("-", "_") for name in without}
        line: list[str] = []
        for action in _parser(self.command)._actions:
            if not action.option_strings or action.dest in left_out or action.dest == "help":
                continue
            value = getattr(self.given, action.dest, action.default)
            if value != action.default:
                line += _tokens(action, value)
        return line

    def section(self, name: str) -> SimpleNamespace:
        """The options of one section (module docstring), checked values."""
        title = SECTIONS[name]
        groups = _parser(self.command)._action_groups
        group = next((g for g in groups if (g.title or "").startswith(title)), None)
        if group is None:
            raise AttributeError(f"{self.command} has no {name} options")
        return SimpleNamespace(
            **{a.dest: getattr(self.args, a.dest) for a in group._group_actions if a.dest}
        )

    def __getattr__(self, name: str) -> SimpleNamespace:
        if name in SECTIONS:
            return self.section(name)
        raise AttributeError(name)

    @property
    def world_size(self) -> int:
        """The ranks the launcher starts (1 without ``--nproc-per-node``)."""
        return (self.args.nproc_per_node or 1) * self.args.nnodes


_parsers: dict[str, argparse.ArgumentParser] = {}


def _refuse(message: str) -> NoReturn:
    raise arguments.ArgumentError(message)


def _parser(command: str) -> argparse.ArgumentParser:
    """Train's parser for ``command``, its ``error`` raising :class:`.arguments.ArgumentError`
    (a tool that takes train's options as its own input reports them as one line)."""
    if command not in _parsers:
        parser = arguments.build_parser(command)
        parser.error = _refuse  # type: ignore[method-assign]
        _parsers[command] = parser
    return _parsers[command]
