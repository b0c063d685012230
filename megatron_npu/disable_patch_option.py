"""The ``--disable-patch ID`` command-line option: the per-patch off switch of every command.

Parsing the option changes nothing outside the parsed namespace; the command publishes the ids
(:func:`disable_flag_published`) in ``$MEGATRON_NPU_DISABLE_FLAG`` only while it runs, so the
patcher (:func:`megatron_npu.patcher.disabled_patches`) of this process and of every process it
starts leaves the same patches out. A user's own script adds the option to its parser with
:func:`add_disable_patch_argument`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator

from megatron_npu.patcher import DISABLE_FLAG, DISABLE_FLAG_ENV
from megatron_npu.registry import all_patches


def _known_patch_id(text: str) -> str:
    if text not in {p.id for p in all_patches()}:
        raise argparse.ArgumentTypeError(
            f"no patch has id {text!r}; 'megatron-npu info' lists the ids"
        )
    return text


class _DisablePatchAction(argparse.Action):
    """Collect the ids in the namespace (parsing writes nothing else: no environment)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        ids = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, ids)


@contextlib.contextmanager
def disable_flag_published(ids: Iterable[str]) -> Iterator[None]:
    """While the command runs, ``$MEGATRON_NPU_DISABLE_FLAG`` names the ``--disable-patch`` ids,
    so this process and every process it starts (launched ranks, parity workers) leave the same
    patches out; the variable's previous value is put back afterwards. No ids: nothing changes."""
    ids = list(ids)
    if not ids:
        yield
        return
    previous = os.environ.get(DISABLE_FLAG_ENV)
    os.environ[DISABLE_FLAG_ENV] = ",".join(ids)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DISABLE_FLAG_ENV, None)
        else:
            os.environ[DISABLE_FLAG_ENV] = previous


def add_disable_patch_argument(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--disable-patch ID`` option (the per-patch off switch) to ``parser``."""
    parser.add_argument(
        DISABLE_FLAG,
        dest="disable_patch",
        metavar="ID",
        type=_known_patch_id,
        action=_DisablePatchAction,
        default=[],
        help="do not install this registry patch (repeatable); 'info' reports it as disabled",
    )
