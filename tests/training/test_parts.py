"""The small pieces of megatron_npu.training: sampler, seeds, metrics, console lines, modes."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest

from megatron_npu.files import make_dir
from megatron_npu.training import metrics, security
from megatron_npu.training.data import PretrainingSampler
from megatron_npu.training.model import derived_seed


def test_sampler_gives_each_dp_rank_its_slice_of_each_global_batch():
    # global batch 8 = 2 DP ranks x 2 micro-batches of 2
    ranks = [list(PretrainingSampler(16, 0, 2, r, 2)) for r in range(2)]
    assert ranks[0] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert ranks[1] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    single = [i for batch in PretrainingSampler(16, 0, 2, 0, 1) for i in batch]
    assert sorted(i for r in ranks for b in r for i in b) == single
    # resuming after one step of 8 samples
    assert list(PretrainingSampler(16, 8, 2, 1, 2)) == [[10, 11], [14, 15]]
    with pytest.raises(ValueError):
        PretrainingSampler(16, 16, 2, 0, 1)


def test_derived_seeds_are_stable_and_distinct():
    assert derived_seed(1234, "layer", 3) == derived_seed(1234, "layer", 3)
    assert len({derived_seed(1234, "layer", n) for n in range(1, 65)}) == 64
    assert derived_seed(1234, "model") != derived_seed(1235, "model")
    assert 0 <= derived_seed(7, "x") < 2**63


def _record(step, loss=5.0, skipped=False, t=0.5):
    return metrics.StepRecord(
        step=step,
        lm_loss=loss,
        grad_norm=None if skipped else 1.5,
        lr=1e-3,
        loss_scale=4096.0,
        skipped=skipped,
        step_time_s=t,
        tokens_per_s=512 / t,
    )


def test_console_line_has_megatrons_fields():
    log = metrics.IntervalLog()
    for step, skipped in ((4, False), (5, True)):
        log.add(_record(step, loss=5.5, skipped=skipped))
    line = log.line(train_iters=20, consumed_samples=40, global_batch_size=8)
    assert line.startswith(" iteration        5/      20 | consumed samples:           40 |")
    for field in (
        "elapsed time per iteration (ms): 500.0 |",
        "learning rate: 1.000000E-03 |",
        "global batch size:     8 |",
        "lm loss: 5.500000E+00 |",
        "loss scale: 4096.0 |",
        "number of skipped iterations:   1 |",
    ):
        assert field in line
    assert "grad norm" not in line  # the last step of the interval was skipped


def test_summary_excludes_warmup_steps_and_counts_skips(tmp_path):
    run = metrics.RunMetrics({"arguments": {}, "device": "npu-emulated"}, tokens_per_step=512)
    for step, t in enumerate((9.0, 7.0, 1.0, 2.0, 3.0), start=1):
        run.add(_record(step, t=t, skipped=step == 4))
    run.peak_memory_bytes = 123
    summary = run.summary()
    assert summary["median_step_time_s"] == 2.0 and summary["tokens_per_s"] == 256.0
    assert summary["skipped_steps"] == 1 and summary["peak_memory_bytes"] == 123
    out = tmp_path / "m.json"
    run.write(str(out))
    data = json.loads(out.read_text())
    assert data["config"]["device"] == "npu-emulated"
    assert [s["step"] for s in data["steps"]] == [1, 2, 3, 4, 5]
    assert set(data["steps"][0]) == {
        "step",
        "lm_loss",
        "grad_norm",
        "lr",
        "loss_scale",
        "skipped",
        "step_time_s",
        "tokens_per_s",
    }
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640
    assert not [p for p in os.listdir(tmp_path) if p != "m.json"]  # no temp file left


def test_run_config_names_the_device_as_it_is():
    from argparse import Namespace

    from megatron_npu.devices.base import Device

    device = Device("npu-emulated", "cpu", "gloo", accelerator=None, emulated=True)
    args = Namespace(world_size=2, data_parallel_size=1, num_microbatches=4, lr=1e-3)
    config = metrics.run_config(args, device)
    assert config["device"] == "npu-emulated" and config["device_emulated"] is True
    assert config["world_size"] == 2 and config["arguments"]["lr"] == 1e-3
    assert {"torch", "megatron-core", "python"} <= set(config["versions"])


def test_harden_tree_and_umask(tmp_path):
    root = tmp_path / "ckpt"
    (root / "iter_0000001").mkdir(parents=True)
    (root / "iter_0000001" / "a.distcp").write_bytes(b"x")
    os.chmod(root / "iter_0000001" / "a.distcp", 0o666)
    security.harden_tree(root)
    assert stat.S_IMODE(os.stat(root / "iter_0000001").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(root / "iter_0000001" / "a.distcp").st_mode) == 0o640
    old = security.set_umask()
    try:
        new_dir = make_dir(tmp_path / "x" / "y")
        assert stat.S_IMODE(os.stat(new_dir).st_mode) == 0o750
        assert stat.S_IMODE(os.stat(tmp_path / "x").st_mode) == 0o750
    finally:
        os.umask(old)


def test_root_warning_is_given_once(monkeypatch):
    monkeypatch.setattr(security, "_root_warned", False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert security.warn_if_root() and security.warn_if_root()
    assert [type(w.message) for w in caught] == [security.RunningAsRootWarning]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(security, "_root_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not security.warn_if_root()
    assert not caught


def test_results_land_even_when_their_folder_does_not_exist_yet(tmp_path):
    from megatron_npu.files import write_private

    target = tmp_path / "runs" / "default" / "metrics.json"
    write_private(target, "{}\n")
    assert target.read_text() == "{}\n"
    assert oct(target.stat().st_mode & 0o777) == "0o640"
    assert oct(target.parent.stat().st_mode & 0o777) == "0o750"
