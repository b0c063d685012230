"""Reliability faults checked in-process, each against its own rule (the fast half;
test_run_faults.py runs them for real).

* token ids outside the tokenizer's vocabulary: the index-file scan and the per-batch check;
* an empty dataset: ``megatron-npu preprocess`` warns (and train refuses it, test_input_faults);
* the divergence guard's rules (exit status 3) on hand-made step sequences;
* ``--metrics-out`` held by another live run, a busy ``--master-port``: one named error before
  any rank starts, and the controls (lock released by its holder's death, port freed) pass;
* a rank's named error reaches the launcher through a pipe;
* hygiene: ``DefaultLoadPlanner`` is pristine after a safe load; ``data`` never imports
  ``training``.

The runs that start processes are in ``test_run_faults.py``.
"""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from pickled_elsewhere import install_module, registered_elsewhere

from megatron_npu.data import index_check
from megatron_npu.patcher import megatron_core_below
from megatron_npu.training import divergence, errors, launch, run_lock, safe_load
from megatron_npu.training.errors import TrainingInputError, TrainingStopped

from ._harness import REPO, TINY, run_env, write_indexed_dataset
from .test_input_faults import LAUNCHED, _patch, run_main

# --- token ids outside the vocabulary ----------------------------------------------------------


def test_index_scan_names_the_out_of_vocab_id(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "corpus")  # uint16 ids below 250
    assert index_check.check_token_ids(str(prefix), 257) is True
    _patch(Path(f"{prefix}.bin"), 2 * 17, np.array([5000], dtype="<u2").tobytes())
    with pytest.raises(TrainingInputError) as info:
        index_check.check_token_ids(str(prefix), 257)
    assert str(info.value).startswith(
        f"--data-path {prefix}: token id 5000 is outside the tokenizer's vocabulary (ids 0..256); "
        "preprocess the data with the tokenizer this run uses"
    ), info.value
    # too large to scan here: not proven, left to the per-batch check
    assert index_check.check_token_ids(str(prefix), 257, scan_limit=10) is False


def test_index_dtype_alone_proves_small_ids(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "corpus")
    _patch(Path(f"{prefix}.idx"), 17, b"\x01")  # uint8: no id can reach a vocabulary of 300
    Path(f"{prefix}.bin").write_bytes(b"\xff" * 480)
    assert index_check.check_token_ids(str(prefix), 300) is True
    with pytest.raises(TrainingInputError, match="token id 255 is outside"):
        index_check.check_token_ids(str(prefix), 255)  # uint8 max 255 >= 255: scanned


def test_each_batch_is_checked_against_the_vocabulary():
    from megatron_npu.training.data import TrainData, checked_token_ids

    data = TrainData(None, 10, "data-path", "x, vocab 10", "/data/corpus")
    good = {"tokens": torch.tensor([[0, 9]]), "labels": torch.tensor([[9, 1]])}
    bad = {"tokens": torch.tensor([[0, 3]]), "labels": torch.tensor([[3, 12]])}
    batches = checked_token_ids(iter([good, bad]), data)
    assert next(batches) is good
    with pytest.raises(TrainingInputError) as info:
        next(batches)
    assert (
        "--data-path /data/corpus: token id 12 is outside the tokenizer's vocabulary (ids 0..9)"
        in str(info.value)
    )
    negative = {"tokens": torch.tensor([[-1, 3]]), "labels": torch.tensor([[3, 1]])}
    with pytest.raises(TrainingInputError, match="token id -1 is outside"):
        next(checked_token_ids(iter([negative]), data))


# --- an empty dataset ---------------------------------------------------------------------------


def test_preprocess_warns_about_an_empty_input(tmp_path, capsys):
    from megatron_npu import cli

    (tmp_path / "empty.jsonl").write_text("")
    code = cli.main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "empty.jsonl"),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "ByteLevel",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert "megatron-npu preprocess: warning: " in err and "0 documents and 0 tokens" in err, err
    assert "megatron-npu train refuses an empty dataset" in err
    (tmp_path / "text.jsonl").write_text('{"text": "hello"}\n')
    cli.main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "text.jsonl"),
            "--output-prefix",
            str(tmp_path / "full"),
            "--tokenizer-type",
            "ByteLevel",
        ]
    )
    assert "warning" not in capsys.readouterr().err  # the control: text, no warning


# --- the divergence guard -----------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


def _feed(guard: divergence.Guard, steps) -> None:
    for step, (loss, skipped, lr) in enumerate(steps, start=1):
        guard.after_step(step, loss, skipped, lr)
    guard.at_end()


def test_guard_stops_after_n_consecutive_nonfinite_losses():
    guard = divergence.Guard(steps_limit=3)
    for step, loss in enumerate([2.0, NAN, INF, 1.5, NAN, NAN], start=1):
        guard.after_step(step, loss, False, 1e-3)  # the finite 1.5 restarts the count
    with pytest.raises(TrainingStopped) as info:
        guard.after_step(7, NAN, False, 1e-3)
    assert info.value.reason == "nonfinite-loss"
    assert guard.diverging  # no save at this step
    assert "NaN/inf for 3 consecutive iterations (5..7)" in str(info.value)
    assert "--no-divergence-stop" in str(info.value)
    assert guard.record(info.value)["exit_status"] == errors.STOPPED_EXIT_STATUS == 3


@pytest.mark.parametrize(
    ("steps", "reason", "words"),
    [
        (
            [(2.0, False, 1.0), (NAN, False, 1.0), (NAN, False, 1.0)],
            "nonfinite-loss",
            "at the last 2 iterations of this run (2..3)",
        ),
        ([(NAN, True, 1.0)] * 2, "nonfinite-loss", "at every iteration of this run (1..2)"),
        ([(5.0, True, 1.0)] * 4, "all-skipped", "skipped the update at every iteration"),
        ([(5.0, False, 0.0)] * 4, "zero-lr", "learning rate was 0 at every iteration"),
    ],
)
def test_guard_end_of_run_rules(steps, reason, words):
    with pytest.raises(TrainingStopped) as info:
        _feed(divergence.Guard(steps_limit=5), steps)
    assert info.value.reason == reason and words in str(info.value), info.value
    _feed(divergence.Guard(steps_limit=5, enabled=False), steps)  # the opt-out


def test_guard_stops_a_scaler_stuck_at_its_smallest_scale():
    guard = divergence.Guard(steps_limit=3, min_loss_scale=1.0)
    # backing off (4, 2) does not count, nor does an applied step at the floor
    for step, (skipped, scale) in enumerate(
        [(True, 4.0), (True, 2.0), (True, 1.0), (False, 1.0), (True, 1.0), (True, 1.0)], start=1
    ):
        guard.after_step(step, 5.0, skipped, 1e-3, scale)
    with pytest.raises(TrainingStopped) as info:
        guard.after_step(7, 5.0, True, 1e-3, 1.0)
    assert info.value.reason == "stuck-loss-scale"
    assert "skipped the update at 3 consecutive iterations (5..7) at its smallest loss scale 1" in (
        str(info.value)
    )
    no_scaler = divergence.Guard(steps_limit=1)  # fp32/bf16: no floor, never this rule
    no_scaler.after_step(1, 5.0, True, 1e-3, 1.0)


def test_guard_says_when_a_save_would_keep_diverged_weights():
    guard = divergence.Guard(steps_limit=5)
    guard.after_step(1, 3.0, False, 1e-3)
    assert not guard.diverging
    guard.after_step(2, NAN, False, 1e-3)
    assert guard.diverging
    guard.after_step(3, 2.5, False, 1e-3)
    assert not guard.diverging
    off = divergence.Guard(steps_limit=5, enabled=False)
    off.after_step(1, NAN, False, 1e-3)
    assert not off.diverging  # the opt-out saves as Megatron-LM would


def test_guard_lets_a_healthy_run_end():
    # warm-up starts at lr 0, an early overflow is skipped, a NaN in the middle recovers
    _feed(
        divergence.Guard(steps_limit=3),
        [
            (5.0, False, 0.0),
            (4.0, True, 1e-3),
            (NAN, False, 1e-3),
            (3.0, False, 1e-3),
        ],
    )


# --- one live run per --metrics-out, a busy --master-port ---------------------------------------


@pytest.mark.parametrize(
    ("flag", "name", "lock"),
    [
        ("--metrics-out", "metrics.json", "metrics.json.lock"),
        ("--save", "ckpt", "ckpt/.megatron-npu.lock"),
    ],
)
def test_output_held_by_a_live_run_is_refused(flag, name, lock, tmp_path, capsys, monkeypatch):
    target, lock = tmp_path / name, tmp_path / lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom megatron_npu.training import run_lock\n"
            f"run_lock.hold({str(target)!r}, {flag!r}, directory={flag == '--save'})\n"
            "print('held', flush=True)\ntime.sleep(300)",
        ],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code, out = run_main([*TINY, flag, str(target)], capsys, monkeypatch)
        assert code == 2 and LAUNCHED not in out and "Traceback" not in out, out
        assert [line for line in out.splitlines() if "error:" in line] == [
            f"megatron-npu train: error: {flag} {target} is in use by another live run "
            f"(process {holder.pid}) (lock {lock}); give this run its own {flag}, or wait for "
            "the other run to end"
        ], out
    finally:
        holder.kill()
        holder.wait()
    # the kernel dropped the dead holder's lock: the same command now reaches the launcher,
    # and the lock this process took is released (and its file removed) when main returns
    with pytest.raises(AssertionError, match=LAUNCHED):
        run_main([*TINY, flag, str(target)], capsys, monkeypatch)
    assert not lock.exists() and not run_lock._held


def test_busy_master_port_is_a_named_error(capsys, monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        code, out = run_main([*TINY, "--master-port", str(port)], capsys, monkeypatch)
    finally:
        listener.close()
    assert code == 2 and LAUNCHED not in out and "Traceback" not in out, out
    assert [line for line in out.splitlines() if "error:" in line] == [
        f"megatron-npu train: error: --master-port {port} is already in use on this machine "
        "(another run, or another program, listens on it); give another --master-port, or "
        "leave it out to take a free one"
    ], out
    with pytest.raises(AssertionError, match=LAUNCHED):  # the control: the port is free now
        run_main([*TINY, "--master-port", str(port)], capsys, monkeypatch)


def test_a_rank_reports_through_its_error_file(tmp_path, monkeypatch, capsys):
    """A rank of the launcher leaves its line in torch elastic's error file and prints nothing;
    torch's own reader of that file (what torchrun's summary shows) reads the same line."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    files = {}
    monkeypatch.setenv(errors.LAUNCHER_PID_ENV, "1")
    for rank, exc in (
        (0, TrainingStopped("zero-lr", "lr 0")),
        (1, TrainingInputError("bad", "fix")),
        (2, TrainingInputError("bad", "fix")),
    ):
        files[rank] = str(tmp_path / f"error-{rank}.json")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv(errors.ERROR_FILE_ENV, files[rank])
        assert errors.report(exc) == (3 if rank == 0 else 2)
    files[3] = str(tmp_path / "absent.json")  # a rank killed before it wrote one
    assert capsys.readouterr() == ("", "")
    assert errors.collect(files, [2]) == {
        "megatron-npu train: error: bad; fix": [1, 2],
        "megatron-npu train: stopped: lr 0": [0],
    }
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=files[1])
    assert failure.message == "megatron-npu train: error: bad; fix"


def test_a_torchrun_rank_prints_its_error_and_fills_torchruns_file(tmp_path, monkeypatch, capsys):
    """Under torchrun (no megatron-npu launcher) the rank says its line itself, with its rank,
    and the error file torchrun gave it carries the same line."""
    monkeypatch.delenv(errors.LAUNCHER_PID_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(errors.ERROR_FILE_ENV, str(tmp_path / "error.json"))
    assert errors.report(TrainingInputError("bad", "fix")) == 2
    assert capsys.readouterr().err == "[rank 1] megatron-npu train: error: bad; fix\n"
    assert errors.collect({1: str(tmp_path / "error.json")}) == {
        "megatron-npu train: error: bad; fix": [1]
    }


def test_rendezvous_namespace_is_per_run():
    class Args:
        nnodes, master_addr = 1, "127.0.0.1"

    assert launch.run_id(Args, 29500) != launch.run_id(Args, 29500)
    Args.nnodes = 2  # every node of one multi-node run must agree on it
    assert launch.run_id(Args, 29500) == launch.run_id(Args, 29500) == "127.0.0.1:29500"


# --- hygiene ------------------------------------------------------------------------------------


def test_load_planner_is_pristine_after_a_safe_load():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    original = DefaultLoadPlanner.load_bytes
    with safe_load.restricted_objects():
        assert DefaultLoadPlanner.load_bytes is not original  # active while the load runs
    assert DefaultLoadPlanner.load_bytes is original
    with pytest.raises(RuntimeError, match="load failed"), safe_load.restricted_objects():
        raise RuntimeError("load failed")
    assert DefaultLoadPlanner.load_bytes is original
    assert (
        "load_bytes" not in vars(DefaultLoadPlanner)
        or vars(DefaultLoadPlanner)["load_bytes"] is original
    )


def test_data_package_never_imports_training():
    package = REPO / "megatron_npu" / "data"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith("megatron_npu.training"), (path.name, name)
    from megatron_npu.data.errors import TrainingInputError as DataError

    assert DataError is TrainingInputError  # one class: the run still reports it as exit 2


def test_safe_load_admits_the_optimizer_classes_an_offload_checkpoint_records(
    tmp_path, monkeypatch
):
    """``--optimizer-cpu-offload`` checkpoints hold their optimizers' classes in every parameter
    group (torch's AdamW on the host; the adaptor's MegatronAdam, or a GPU cluster's Transformer
    Engine FusedAdam, on the device): the safe-load check reads them, still refuses any other
    global by name, and leaves a global registered before it registered."""
    from megatron_npu.optim.precision_aware import MegatronAdam

    with monkeypatch.context() as installed:
        fused = install_module(
            installed, "transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam"
        )
        groups = [
            {"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": MegatronAdam},
            {"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": fused},
        ]
        for name, state in (
            ("offload", {"optimizer": {"param_groups": groups}}),
            ("code", sys.exit),
        ):
            (tmp_path / name).mkdir()
            torch.save({"iteration": 4, "state": state}, tmp_path / name / "common.pt")
    # as here: Transformer Engine is not installed
    with registered_elsewhere(torch.optim.AdamW):
        safe_load.check_common(str(tmp_path / "offload"))
        assert torch.optim.AdamW in torch.serialization.get_safe_globals()
    with pytest.raises(TrainingInputError, match=r"safe load refuses \(.*sys\.exit"):
        safe_load.check_common(str(tmp_path / "code"))


@pytest.mark.parametrize("name", safe_load.MCORE_METADATA_CLASSES)
def test_safe_load_admits_megatron_cores_metadata_classes(name, tmp_path, monkeypatch):
    """megatron-core's torch_dist ``.metadata`` pickles its own plain-data class: the save plan
    up to 0.14, the metadata in 0.15 (torch's ``Metadata`` and a dict of shapes); later releases
    keep both names as empty classes to read such checkpoints. A checkpoint saved by any of them
    passes the check; the module's classes with behaviour (its planners) stay refused."""
    import pickle

    from megatron.core.dist_checkpointing.strategies import torch as strategy

    class Recorded:  # the installed release's class, or one pickled under the same name
        pass

    Recorded.__module__, Recorded.__name__, Recorded.__qualname__ = strategy.__name__, name, name
    monkeypatch.setattr(strategy, name, getattr(strategy, name, Recorded), raising=False)
    cls = getattr(strategy, name)
    recorded = cls.__new__(cls)
    recorded.__dict__.update(
        mcore_data={"embedding.word_embeddings.weight": {"nd_reformulated_orig_global_shape": None}}
    )
    (tmp_path / ".metadata").write_bytes(pickle.dumps(recorded))
    safe_load.check_metadata(str(tmp_path / ".metadata"))

    planner = strategy.MCoreLoadPlanner.__new__(strategy.MCoreLoadPlanner)
    (tmp_path / "planner").write_bytes(pickle.dumps(planner))
    with pytest.raises(TrainingInputError, match=r"refers to .*\.MCoreLoadPlanner, which safe"):
        safe_load.check_metadata(str(tmp_path / "planner"))


@pytest.mark.skipif(
    megatron_core_below("0.19"),
    reason="megatron-core keeps the common state in common.pt up to 0.18 (tested above)",
)
def test_safe_load_reads_the_common_state_object_of_a_torch_dist_checkpoint(tmp_path):
    """From megatron-core 0.19 the common state is an object shard of the torch_dist checkpoint,
    not ``common.pt``: the check reads it through megatron-core's loader, admits the recorded
    optimizer classes without a warning, and refuses any other global naming it, in the
    shard's own pickle (which torch's planner alone would load with ``weights_only=False``: the
    crafted one runs nothing) as in the state pickled inside it. A checkpoint without the
    object is one named error."""
    import io

    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    ran = tmp_path / "the crafted shard ran"

    class Crafted:
        def __reduce__(self):
            return (Path.touch, (ran,))

    def save(name: str, shard) -> str:
        path = tmp_path / name
        path.mkdir()
        save_config(CheckpointingConfig("torch_dist"), str(path))
        dcp.save(
            {"something else": torch.zeros(1)} if shard is None else {key: shard},
            checkpoint_id=str(path),
            no_dist=True,
        )
        assert not (path / "common.pt").exists()
        return str(path)

    def packed(common: dict) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save([common], buffer)
        return buffer

    groups = [{"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": torch.optim.AdamW}]
    offload = save("offload", packed({"optimizer": {"param_groups": groups}}))
    with warnings.catch_warnings(record=True) as said:  # the launcher's one-process read
        warnings.simplefilter("always")
        safe_load.check_common(offload)
    assert not [w for w in said if "torch.distributed is disabled" in str(w.message)]
    with pytest.raises(TrainingInputError, match=r"holds more than tensors .*sys\.exit"):
        safe_load.check_common(save("code", packed({"iteration": 4, "hook": sys.exit})))
    with pytest.raises(
        TrainingInputError, match=r"common_state/\S+ holds more than tensors .*getattr"
    ):
        safe_load.check_common(save("crafted-shard", Crafted()))
    assert not ran.exists()
    with pytest.raises(TrainingInputError, match=r"common state is unreadable .*common_state"):
        safe_load.check_common(save("no-common-state", None))
