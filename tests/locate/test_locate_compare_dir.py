"""``locate --compare-dir`` on a real ``compare`` output with a held-out bug: the emulated NPU
AdamW kernel steps with 1.5x the learning rate (``tests/compare/plants``, not one of the parity
harness's mutations). compare fails the pair; locate, reading the runs from compare's folder,
names the first divergent step, a parameter update as the divergent module and the patch that
routes Megatron's AdamW to that kernel."""

from __future__ import annotations

import argparse
import sys

import pytest
from planting import plant_env

from megatron_npu.compare import command as compare_command
from megatron_npu.compare import matrix as m
from megatron_npu.formats.locate_result import LocateResult
from megatron_npu.locate import command
from tests.locate.test_locate_script import COMMON
from tests.megatron_lm._client import megatron_lm_folder

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MATRIX = """
[compare]
baseline = "ref"
lambada = false

[defaults]
layout-independent-init = true
num-layers = 2
hidden-size = 64
num-attention-heads = 4
seq-length = 64
micro-batch-size = 2
global-batch-size = 4
train-iters = 6
lr = 1e-3
lr-warmup-iters = 1
attention-dropout = 0.0
hidden-dropout = 0.0

[[run]]
name = "ref"
device = "cpu"

[[run]]
name = "npu"
device = "npu-emulated"
reference = "ref"
"""
#: the patches that put the adaptor's AdamW (and its NPU kernel) in Megatron's optimizer
ADAMW = {"optimizer.adam", "optimizer.factory-torch-adamw"}


@pytest.mark.extended
def test_locate_reads_a_failing_compare_pair_and_names_the_optimizer(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key, value in plant_env("wrong-adamw").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    (tmp_path / "m.toml").write_text(MATRIX)
    document, status = compare_command.run_compare(m.load(tmp_path / "m.toml"), tmp_path / "out")
    verdict = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}[("npu", "approximate")]
    assert status == 1 and verdict["status"] == "fail", verdict

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        [
            "--compare-dir",
            str(tmp_path / "out"),
            "--pair",
            "ref",
            "npu",
            "--out",
            str(tmp_path / "loc"),
        ]
    )
    data = command.locate(args)
    # the first step whose loss or grad norm leaves the approximate rule, from compare's curves
    runs = {r["name"]: r for r in document["runs"]}
    assert data["step"]["step"] is not None and data["step"]["step"] > 1  # step 1 is the same
    assert data["step"]["approximate"]["status"] == "fail"
    found = data["divergent"]
    assert (found["kind"], found["phase"]) == ("optimizer", "update"), found
    culprits = data["culprit"]["culprits"]
    assert culprits and set(culprits) <= ADAMW, data["culprit"]
    saved = LocateResult.read(tmp_path / "loc" / "locate.json")
    assert saved.divergent.module == found["module"] and runs["npu"]["emulated"] is True


def test_locate_reads_a_compare_pair_of_script_runs(tmp_path, monkeypatch):
    """The same on compare's script runs: Megatron-LM's own ``pretrain_gpt.py`` on cpu and on
    npu-emulated with the emulated ``npu_rms_norm`` kernel 2 % too large, a pair compare passes.
    locate takes each run's script, arguments and device from compare's ``run.json`` and
    ``metrics.json``, replays step 1 through the script and names the norm and the patch that
    routes it to the kernel."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for key, value in plant_env("rms-norm-2pct").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    script = megatron_lm_folder() / "pretrain_gpt.py"
    args = ", ".join(f'"{a}"' for a in COMMON)
    runs = "".join(
        f'[[run]]\nname = "{name}"\nscript = "{script}"\nargs = [{args}]\ndevice = "{device}"\n'
        for name, device in (("mlm-cpu", "cpu"), ("mlm-npu", "npu-emulated"))
    )
    (tmp_path / "m.toml").write_text(f'[compare]\nbaseline = "mlm-cpu"\nlambada = false\n{runs}')
    document, status = compare_command.run_compare(m.load(tmp_path / "m.toml"), tmp_path / "out")
    # the loss moves less than compare's 2 % and the grad norm less than its 10 %: the pair passes
    verdict = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    assert verdict[("mlm-npu", "approximate")]["status"] == "pass" and status == 0, verdict

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        [
            "--compare-dir",
            str(tmp_path / "out"),
            "--pair",
            "mlm-cpu",
            "mlm-npu",
            "--out",
            str(tmp_path / "loc"),
        ]
    )
    data = command.locate(args)
    assert data["candidate"]["script"] == str(script)
    assert (data["reference"]["device"], data["candidate"]["device"]) == ("cpu", "npu-emulated")
    # locate's curve rule sees step 1's grad norm already 2 % apart
    assert (data["step"]["step"], data["step"]["quantity"]) == (1, "grad_norm"), data["step"]
    found = data["divergent"]
    assert (found["module"], found["phase"]) == ("decoder.layers.0.input_layernorm", "forward")
    assert data["culprit"]["culprits"] == ["norm.wrapped-torch-norm"], data["culprit"]
    assert "--compare-dir" in data["reproduce"]
