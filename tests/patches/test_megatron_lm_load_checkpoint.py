"""``megatron-lm.load-checkpoint``: Megatron-LM's checkpoint load with the hybrid optimizer's
classes allowed, and its ``sys.exit()`` (status 0) after a failed load (the read, the tracker
file, the iteration, the rng state) turned into one named line and status 2 on the rank that
failed, while its deliberate ``--exit-on-missing-checkpoint`` exit stays. Megatron-LM's own
function is stood in for by one that fails as it does (prints why, then ``sys.exit()``); the
end-to-end case is
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


def _megatron_lm_load(exit_code=None, returns=None):
    """Megatron-LM's ``load_checkpoint`` signature; a load that fails the way it does."""

    def load_checkpoint(
        ddp_model,
        optimizer,
        opt_param_scheduler,
        load_arg="load",
        strict=True,
        checkpointing_context=None,
        skip_load_to_model_and_opt=False,
    ):
        if returns is not None:
            return returns()
        print("Unable to load rng state from checkpoint ..., exiting ...")
        sys.exit(exit_code)

    return load_checkpoint


@pytest.fixture
def checkpointing(monkeypatch, tmp_path):
    """Megatron-LM's modules as far as the wrapper reads them (the run's arguments, the tracker
    file name), a checkpoint folder with a tracker, and no wait for rank 0's line. Returns the
    run's arguments, with ``load`` at that folder."""
    run_args = SimpleNamespace(
        load=str(tmp_path),
        pretrained_checkpoint=None,
        exit_on_missing_checkpoint=False,
        ckpt_step=None,
    )
    module = ModuleType("megatron.training.checkpointing")
    module.get_checkpoint_tracker_filename = lambda root: os.path.join(
        root, "latest_checkpointed_iteration.txt"
    )
    global_vars = ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: run_args
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", module)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    monkeypatch.setattr(megatron_lm, "_OTHER_RANKS_EXIT_AFTER_S", 0.0)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    return run_args


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("megatron-npu: ")]


def _load(wrapped, **kwargs):
    """Call the wrapped load as Megatron-LM's ``setup_model_and_optimizer`` does."""
    return wrapped(["model"], "optimizer", "scheduler", **kwargs)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_failed_load_is_one_named_line_and_status_2_on_the_rank_that_failed(
    checkpointing, monkeypatch, caplog, rank
):
    """Rank 0 says it at once; another rank (a file only it reads) says it after the wait it
    gives rank 0, so one line appears whichever rank failed."""
    monkeypatch.setenv("RANK", rank)
    load = megatron_lm._load_checkpoint(_megatron_lm_load())
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        _load(load)
    assert exited.value.code == 2
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith(LINE + checkpointing.load), lines


def test_the_line_names_the_option_whose_folder_was_loaded(checkpointing, monkeypatch, caplog):
    """``load_arg`` picks the argument that holds the folder (Megatron-LM's own callers pass
    ``load`` or ``pretrained_checkpoint``)."""
    monkeypatch.setenv("RANK", "0")
    checkpointing.pretrained_checkpoint = "/pretrained"
    load = megatron_lm._load_checkpoint(_megatron_lm_load())
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        _load(load, load_arg="pretrained_checkpoint")
    assert _lines(caplog) == [
        "megatron-npu: Megatron-LM could not load the checkpoint: --pretrained-checkpoint "
        "/pretrained: the reason is printed above; Megatron-LM would exit with status 0 having "
        "trained nothing"
    ]


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
        ({"exit_on_missing_checkpoint": True}, True, None, True),  # the load itself failed
        ({"exit_on_missing_checkpoint": True, "ckpt_step": 6}, False, None, True),
        # the pretrained folder was read (Megatron-LM raises where neither has a checkpoint)
        ({"exit_on_missing_checkpoint": True, "pretrained_checkpoint": "/p"}, False, None, True),
        ({}, False, None, True),
        ({}, True, 3, False),  # a status of its own passes through
    ],
    ids=[
        "missing-checkpoint-exit",
        "tracker-present",
        "ckpt-step",
        "pretrained",
        "plain",
        "own-status",
    ],
)
def test_only_a_silent_exit_after_a_failed_load_is_converted(
    checkpointing, monkeypatch, caplog, asked, tracker, exit_code, converted
):
    monkeypatch.setenv("RANK", "0")
    if not tracker:
        os.unlink(os.path.join(checkpointing.load, "latest_checkpointed_iteration.txt"))
    vars(checkpointing).update(asked)
    load = megatron_lm._load_checkpoint(_megatron_lm_load(exit_code))
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        _load(load)
    assert exited.value.code == (2 if converted else exit_code)
    assert len(_lines(caplog)) == converted


def test_the_load_sees_the_hybrid_optimizers_classes_allowed(checkpointing):
    """Inside the load torch's ``weights_only`` load admits the classes a hybrid optimizer
    records (the legacy file's parameter groups hold them); after it, only what was allowed
    before."""
    before = set(map(str, torch.serialization.get_safe_globals()))
    load = megatron_lm._load_checkpoint(
        _megatron_lm_load(returns=torch.serialization.get_safe_globals)
    )
    inside = _load(load)
    assert torch.optim.AdamW in inside and torch.optim.SGD in inside
    assert set(map(str, torch.serialization.get_safe_globals())) == before
