"""``megatron-lm.load-checkpoint``: Megatron-LM's checkpoint read with the hybrid optimizer's
classes allowed, and its ``sys.exit()`` (status 0) after a failed read turned into one named line
and status 2 on the rank that failed, while its deliberate ``--exit-on-missing-checkpoint`` exit
stays. Megatron-LM's own function is stood in for by one that fails as it does (prints why, then
``sys.exit()``); the end-to-end case is
``tests/megatron_lm/test_pretrain_gpt.py::test_legacy_checkpoint_of_an_offloaded_optimizer_resumes_bitwise``.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from megatron_npu.patches import megatron_lm

LINE = "megatron-npu: Megatron-LM could not load the checkpoint: --load "


def _megatron_lm_read(exit_code=None, returns=None):
    """Megatron-LM's ``_load_base_checkpoint`` signature; a read that fails the way it does."""

    def _load_base_checkpoint(
        load_dir, args, rank0=False, sharded_state_dict=None, checkpointing_context=None
    ):
        if returns is not None:
            return returns()
        print("could not load the checkpoint")
        sys.exit(exit_code)

    return _load_base_checkpoint


@pytest.fixture
def checkpointing(monkeypatch, tmp_path):
    """Megatron-LM's checkpointing module as far as the wrapper reads it (its tracker file name),
    a checkpoint folder with a tracker, and no wait for rank 0's line."""
    module = ModuleType("megatron.training.checkpointing")
    module.get_checkpoint_tracker_filename = lambda root: os.path.join(
        root, "latest_checkpointed_iteration.txt"
    )
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", module)
    monkeypatch.setattr(megatron_lm, "_OTHER_RANKS_EXIT_AFTER_S", 0.0)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    return tmp_path


def _args(**asked):
    return SimpleNamespace(**{"exit_on_missing_checkpoint": False, "ckpt_step": None, **asked})


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("megatron-npu: ")]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_failed_read_is_one_named_line_and_status_2_on_the_rank_that_failed(
    checkpointing, monkeypatch, caplog, rank
):
    """Rank 0 says it at once; another rank (a file only it reads) says it after the wait it
    gives rank 0, so one line appears whichever rank failed."""
    monkeypatch.setenv("RANK", rank)
    read = megatron_lm._load_base_checkpoint(_megatron_lm_read())
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        read(str(checkpointing), _args(), rank0=False)
    assert exited.value.code == 2
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith(LINE + str(checkpointing)), lines


def test_other_option_refusals_are_said_by_rank_0_alone(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(megatron_lm, "_OTHER_RANKS_EXIT_AFTER_S", 0.0)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        megatron_lm._refuse(megatron_lm.MegatronLMOptionError(["--x: why"]))
    assert _lines(caplog) == []


@pytest.mark.parametrize(
    "asked, tracker, exit_code, converted",
    [
        ({"exit_on_missing_checkpoint": True}, False, None, False),  # Megatron-LM's own exit
        ({"exit_on_missing_checkpoint": True}, True, None, True),  # the read itself failed
        ({"exit_on_missing_checkpoint": True, "ckpt_step": 6}, False, None, True),
        ({}, False, None, True),
        ({}, True, 3, False),  # a status of its own passes through
    ],
    ids=["missing-checkpoint-exit", "tracker-present", "ckpt-step", "plain", "own-status"],
)
def test_only_a_silent_exit_after_a_failed_read_is_converted(
    checkpointing, monkeypatch, caplog, asked, tracker, exit_code, converted
):
    monkeypatch.setenv("RANK", "0")
    if not tracker:
        (checkpointing / "latest_checkpointed_iteration.txt").unlink()
    read = megatron_lm._load_base_checkpoint(_megatron_lm_read(exit_code))
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        read(str(checkpointing), _args(**asked))
    assert exited.value.code == (2 if converted else exit_code)
    assert len(_lines(caplog)) == converted


def test_the_read_sees_the_hybrid_optimizers_classes_allowed(checkpointing):
    """Inside the read torch's ``weights_only`` load admits the classes a hybrid optimizer
    records (the legacy file's parameter groups hold them); after it, only what was allowed
    before."""
    before = set(map(str, torch.serialization.get_safe_globals()))
    read = megatron_lm._load_base_checkpoint(
        _megatron_lm_read(returns=torch.serialization.get_safe_globals)
    )
    inside = read(str(checkpointing), _args())
    assert torch.optim.AdamW in inside and torch.optim.SGD in inside
    assert set(map(str, torch.serialization.get_safe_globals())) == before
