"""Save at step 5 with TP2, resume with TP1 and with PP2: steps 6-10 are the uninterrupted TP2
run's (model, optimizer state, scheduler and data position restored); files 0640, dirs 0750;
every save carries a manifest (per-file SHA-256, model fingerprint, LR schedule); dropout and SGD
momentum resume exactly in the same layout."""

from __future__ import annotations

import os
import stat

import pytest

from ._runner import TINY, max_abs_diff, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOLERANCE = 1e-5
RESUMED = range(6, 11)


def test_checkpoint_layout_and_modes(tp2_saved):
    _, save = tp2_saved
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert (save / "iter_0000005").is_dir() and (save / "iter_0000010").is_dir()
    seen_files = 0
    for directory, _dirs, files in os.walk(save):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o750, directory
        for name in files:
            path = os.path.join(directory, name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o640, path
            seen_files += 1
    assert seen_files > 4
    assert not list(save.glob("*.partial"))  # committed saves leave no work directory


def test_manifest_records_checksums_fingerprint_and_schedule(tp2_saved):
    import hashlib
    import json

    _, save = tp2_saved
    manifest = json.loads((save / "iter_0000005" / "megatron_npu_checkpoint.json").read_text())
    assert manifest["iteration"] == 5
    assert manifest["fingerprint"]["hidden_size"] == 64
    assert manifest["fingerprint"]["padded_vocab_size"] == 256
    assert manifest["scheduler"]["lr_decay_steps"] == 10 * 8  # samples: iters x global batch
    files = manifest["files"]
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)
    for name, entry in files.items():
        data = (save / "iter_0000005" / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # the manifest's model reads the file and writes it back byte for byte
    from megatron_npu.formats.checkpoint_manifest import CheckpointManifest

    path = save / "iter_0000005" / "megatron_npu_checkpoint.json"
    read = CheckpointManifest.read(path)
    assert read.arguments.global_batch_size == 8 and read.files[".metadata"].bytes > 0
    assert read.to_json() == path.read_text()


def test_checkpoint_holds_optimizer_scheduler_and_rng(tp2_saved):
    from megatron.core import dist_checkpointing

    _, save = tp2_saved
    path = str(save / "iter_0000005")
    keys = set(dist_checkpointing.load_tensors_metadata(path))
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in keys)
    common = dist_checkpointing.load_common_state_dict(path)
    assert common["iteration"] == 5 and common["consumed_train_samples"] == 40
    assert common["opt_param_scheduler"]["num_steps"] == 40
    assert common["layout"]["tensor_model_parallel_size"] == 2
    assert common["saved_rng"] is True


def test_metrics_file_is_private(tp2_saved):
    run, _ = tp2_saved
    assert stat.S_IMODE(os.stat(run.metrics_path).st_mode) == 0o640


@pytest.mark.parametrize(
    "name, nproc, layout",
    [("tp1", 1, []), ("pp2", 2, ["--pipeline-model-parallel-size", "2"])],
)
def test_resume_into_another_layout(name, nproc, layout, tp2_saved, train_tmp):
    uninterrupted, save = tp2_saved
    run = train(
        train_tmp,
        *TINY,
        "--train-iters",
        "10",
        *layout,
        "--load",
        str(save),
        "--ckpt-step",
        "5",
        nproc=nproc,
        name=f"resume-{name}",
    )
    assert [s.step for s in run.steps] == list(RESUMED)
    assert run.metrics.config.resumed_from.endswith("iter_0000005")
    assert "RNG state not restored" in run.stdout  # another (TP, PP) layout
    diff = max_abs_diff(run.losses, uninterrupted.losses, RESUMED)
    print(f"\nresume TP2@5 -> {name}: max |loss - uninterrupted TP2| over steps 6-10 = {diff:.3e}")
    assert diff <= TOLERANCE, (run.losses, uninterrupted.losses)


def test_resume_distributed_optimizer_into_another_dp_and_tp(dp2_saved, train_tmp):
    """DP2 distributed-optimizer state (fully_reshardable) loads into TP2 x DP1."""
    uninterrupted, save = dp2_saved
    run = train(
        train_tmp,
        *TINY,
        "--train-iters",
        "10",
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--load",
        str(save),
        "--ckpt-step",
        "5",
        nproc=2,
        name="resume-distopt-tp2",
    )
    assert [s.step for s in run.steps] == list(RESUMED)
    diff = max_abs_diff(run.losses, uninterrupted.losses, RESUMED)
    print(f"\nresume DP2 distopt@5 -> TP2 distopt: max |loss diff| over steps 6-10 = {diff:.3e}")
    assert diff <= TOLERANCE, (run.losses, uninterrupted.losses)


def test_optimizer_kind_mismatch_is_refused(dp2_saved, train_tmp):
    _, save = dp2_saved
    with pytest.raises(AssertionError, match="was saved with --use-distributed-optimizer"):
        train(
            train_tmp,
            *TINY,
            "--train-iters",
            "6",
            "--load",
            str(save),
            "--ckpt-step",
            "5",
            name="resume-kind-mismatch",
        )


def _with(args: list[str], **values: str) -> list[str]:
    out = list(args)
    for flag, value in values.items():
        out[out.index("--" + flag.replace("_", "-")) + 1] = value
    return out


def test_resume_with_dropout_and_sgd_momentum_is_exact(train_tmp):
    """Same layout, dropout on, SGD with momentum: the resumed steps equal the uninterrupted
    run's bit for bit (the RNG state, the momentum buffers and the data position are restored,
    and starting the data iterator draws nothing from the restored generator)."""
    args = [*_with(TINY, attention_dropout="0.1", hidden_dropout="0.1"), "--optimizer", "sgd"]
    save = train_tmp / "ckpt_sgd_dropout"
    whole = train(
        train_tmp,
        *args,
        "--train-iters",
        "6",
        "--save",
        str(save),
        "--save-interval",
        "3",
        name="sgd-dropout",
    )
    resumed = train(
        train_tmp,
        *args,
        "--train-iters",
        "6",
        "--load",
        str(save),
        "--ckpt-step",
        "3",
        name="sgd-dropout-resumed",
    )
    assert [s.step for s in resumed.steps] == [4, 5, 6]
    assert "RNG state not restored" not in resumed.stdout
    assert {s: resumed.losses[s] for s in (4, 5, 6)} == {s: whole.losses[s] for s in (4, 5, 6)}


def test_a_checkpoint_saved_before_any_applied_update_resumes_exactly(train_tmp):
    """fp16 skips its first updates (the loss scale starts at 2**32): a checkpoint saved while
    every update so far was skipped has Adam moments the optimizer never made. It is saved
    complete (zero moments, step 0) and resumes to the uninterrupted run's losses bit for bit
    (it used to fail on load: exp_avg missing, then torch's KeyError 'step')."""
    args = [*TINY, "--fp16", "--no-divergence-stop", "--train-iters", "20"]
    save = train_tmp / "ckpt_fp16_all_skipped"
    whole = train(train_tmp, *args, "--save", str(save), "--save-interval", "2", name="fp16")
    assert all(s.skipped for s in whole.steps[:2]) and not whole.steps[-1].skipped
    resumed = train(train_tmp, *args, "--load", str(save), "--ckpt-step", "2", name="fp16-resumed")
    assert [s.step for s in resumed.steps] == list(range(3, 21))
    applied = [s for s in range(3, 21) if not whole.steps[s - 1].skipped]
    assert applied, "the run must apply updates after the checkpoint"
    assert {s: resumed.losses[s] for s in applied} == {s: whole.losses[s] for s in applied}


def test_resume_with_half_the_optimizer_offloaded_is_exact(train_tmp):
    """``--optimizer-cpu-offload`` on two data-parallel ranks, half the parameters stepped by the
    host optimizer: the checkpoint (``fully_reshardable``, whose common state holds both
    optimizers' classes) passes the safe-load check, loads into the fresh offloading optimizer
    (which Megatron initialises itself), and the resumed steps equal the uninterrupted run's bit
    for bit."""
    args = [
        *TINY,
        "--bf16",
        "--use-distributed-optimizer",
        "--use-precision-aware-optimizer",
        "--optimizer-cpu-offload",
        "--optimizer-offload-fraction",
        "0.5",
        "--train-iters",
        "6",
    ]
    save = train_tmp / "ckpt_offload"
    whole = train(
        train_tmp, *args, "--save", str(save), "--save-interval", "3", nproc=2, name="offload"
    )
    resumed = train(
        train_tmp,
        *args,
        "--load",
        str(save),
        "--ckpt-step",
        "3",
        nproc=2,
        name="offload-resumed",
    )
    assert [s.step for s in resumed.steps] == [4, 5, 6]
    assert {s: resumed.losses[s] for s in (4, 5, 6)} == {s: whole.losses[s] for s in (4, 5, 6)}
