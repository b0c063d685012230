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
#: stands for a ``--pretrained-checkpoint`` folder that holds a checkpoint
PRETRAINED = "<pretrained folder>"


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
    """Megatron-LM's modules as far as the wrapper reads them (the run's arguments, whether a
    folder holds a checkpoint), a checkpoint folder with a tracker, and no wait for rank 0's
    line. Returns the run's arguments, with ``load`` at that folder."""
    run_args = SimpleNamespace(
        load=str(tmp_path),
        pretrained_checkpoint=None,
        exit_on_missing_checkpoint=False,
        ckpt_step=None,
    )
    module = ModuleType("megatron.training.checkpointing")
    module.checkpoint_exists = lambda root: (
        root is not None and os.path.isfile(os.path.join(root, "latest_checkpointed_iteration.txt"))
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
    """``load_arg`` picks the argument that holds the folder (Megatron-LM's knowledge-distillation
    export passes ``export_kd_teacher_load``)."""
    monkeypatch.setenv("RANK", "0")
    checkpointing.export_kd_teacher_load = "/teacher"
    load = megatron_lm._load_checkpoint(_megatron_lm_load())
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        _load(load, load_arg="export_kd_teacher_load")
    assert _lines(caplog) == [
        "megatron-npu: Megatron-LM could not load the checkpoint: --export-kd-teacher-load "
        "/teacher: the reason is printed above; Megatron-LM would exit with status 0 having "
        "trained nothing"
    ]


@pytest.mark.parametrize("load_has_checkpoint", [False, True])
def test_the_line_names_the_pretrained_folder_where_megatron_lm_read_it(
    checkpointing, monkeypatch, caplog, load_has_checkpoint
):
    """``load_checkpoint`` reads ``--pretrained-checkpoint`` where ``--load`` holds no
    checkpoint: the line names the folder that was read."""
    monkeypatch.setenv("RANK", "0")
    checkpointing.pretrained_checkpoint = "/pretrained"
    if not load_has_checkpoint:
        os.unlink(os.path.join(checkpointing.load, "latest_checkpointed_iteration.txt"))
    load = megatron_lm._load_checkpoint(_megatron_lm_load())
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        _load(load)
    named = f"--load {checkpointing.load}:" if load_has_checkpoint else "--pretrained-checkpoint "
    assert len(_lines(caplog)) == 1 and named in _lines(caplog)[0], _lines(caplog)


def test_checkpoint_args_read_before_training_is_one_named_line(checkpointing, monkeypatch, caplog):
    """``--use-checkpoint-args`` reads the checkpoint through ``load_args_from_checkpoint(args,
    load_arg)`` before Megatron-LM's global arguments exist: the wrapper takes the arguments it
    was given, and never reads the pretrained folder (that function does not switch)."""
    monkeypatch.setenv("RANK", "0")
    sys.modules["megatron.training.global_vars"].get_args = lambda: pytest.fail("not set yet")

    def load_args_from_checkpoint(args, load_arg="load", checkpointing_context=None):
        print("could not load the checkpoint")
        sys.exit()

    run_args = SimpleNamespace(**{**vars(checkpointing), "pretrained_checkpoint": "/pretrained"})
    os.unlink(os.path.join(checkpointing.load, "latest_checkpointed_iteration.txt"))
    read = megatron_lm._load_args_from_checkpoint(load_args_from_checkpoint)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        read(run_args)
    assert exited.value.code == 2
    assert len(_lines(caplog)) == 1 and f"--load {checkpointing.load}:" in _lines(caplog)[0]


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
        # the pretrained folder, which holds one, was read (Megatron-LM raises where neither has)
        (
            {"exit_on_missing_checkpoint": True, "pretrained_checkpoint": PRETRAINED},
            False,
            None,
            True,
        ),
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
    checkpointing, monkeypatch, caplog, tmp_path, asked, tracker, exit_code, converted
):
    monkeypatch.setenv("RANK", "0")
    if not tracker:
        os.unlink(os.path.join(checkpointing.load, "latest_checkpointed_iteration.txt"))
    if asked.get("pretrained_checkpoint") == PRETRAINED:
        pretrained = tmp_path / "pretrained"
        pretrained.mkdir()
        (pretrained / "latest_checkpointed_iteration.txt").write_text("6")
        asked = {**asked, "pretrained_checkpoint": str(pretrained)}
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
