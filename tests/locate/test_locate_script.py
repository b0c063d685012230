"""``locate --script``: both runs are Megatron-LM's own ``pretrain_gpt.py`` (the tag of the
installed megatron-core, unmodified) through the adaptor, the reference on cpu and the candidate
on npu-emulated, replayed with the script's own ``--save``/``--load``/``--exit-interval``.

The planted bug is held out from the parity harness: the emulated ``npu_rms_norm`` kernel returns
its output 2 % too large (``tests/compare/plants``). Switching the norm patch off cannot run
here (Megatron-LM's default ``persist_layer_norm`` asserts in the stock local norm), so the
search must name the patch through its kernel served natively."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
from planting import plant_env

from megatron_npu.locate import command, curves, dump
from tests.megatron_lm._client import TINY, megatron_lm_folder

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LLAMA = (
    "--position-embedding-type",
    "rope",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
)
COMMON = (
    *TINY,
    *LLAMA,
    "--mock-data",
    "--train-iters",
    "4",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
)


def _locate(tmp_path: Path, monkeypatch, plant: str | None) -> tuple[int, dict]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    if plant:
        for key, value in plant_env(plant).items():
            monkeypatch.setenv(key, value)
    else:
        monkeypatch.delenv("MEGATRON_NPU_TEST_PLANT", raising=False)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        [
            "--script",
            str(megatron_lm_folder() / "pretrain_gpt.py"),
            "--common",
            shlex.join(COMMON),
            "--reference",
            "--device cpu",
            "--candidate",
            "--device npu-emulated",
            "--out",
            str(tmp_path / "loc"),
        ]
    )
    status = command.main(args)
    return status, json.loads((tmp_path / "loc" / "locate.json").read_text())


# the same script replay, module and patch are named by default from compare's script runs
# (tests/locate/test_locate_compare_dir.py); this reaches locate's --script/--common entry
@pytest.mark.extended
def test_locate_on_pretrain_gpt_names_the_step_module_and_planted_kernel_patch(
    tmp_path, monkeypatch
):
    status, data = _locate(tmp_path, monkeypatch, "rms-norm-2pct")
    assert status == 0
    assert data["step"]["step"] == 1, data["step"]
    assert data["candidate"]["script"].endswith("pretrain_gpt.py")
    divergent = data["divergent"]
    assert divergent["module"] == "decoder.layers.0.input_layernorm", divergent
    assert divergent["phase"] == "forward", divergent
    culprit = data["culprit"]
    assert culprit["culprits"] == ["norm.wrapped-torch-norm"], culprit
    assert culprit["kernels"] == ["npu_rms_norm"], culprit
    assert "--script" in data["reproduce"]
    # the candidate's dump says which kernels it served natively (none) and that it had kernels
    meta = dump.read_meta(tmp_path / "loc" / "dumps" / "candidate")
    assert meta.npu_kernels is True and meta.native_kernels == []


@pytest.mark.extended
def test_locate_on_a_healthy_pretrain_gpt_pair_names_nothing(tmp_path, monkeypatch):
    status, data = _locate(tmp_path, monkeypatch, None)
    assert status == 0
    assert data["step"]["step"] is None, data["step"]
    assert data["divergent"] is None and data["culprit"] is None, data["divergent"]
    assert data["modules"], "step 1 was compared module by module"
    # the script's own logs carry the same curves to their printed digits (the second line, which
    # Megatron-LM 0.16+ prints as the mean of steps 1 and 2, read back as step 2's own), so a
    # user's logs can stand in for the curve runs: read back with --reference-curve /
    # --candidate-curve they agree too
    logs = tmp_path / "loc" / "logs"
    hooked = curves.read_curve(tmp_path / "loc" / "curves" / "reference.json")
    logged = curves.read_curve(logs / "curve-reference.log")
    assert logged.iterations == hooked.iterations == [1, 2, 3, 4]
    for i in range(4):
        assert logged.losses[i] == pytest.approx(hooked.losses[i], rel=1.5e-6)
        assert logged.grad_norms[i] == pytest.approx(hooked.grad_norms[i], abs=5e-4)
    finding = curves.first_divergent_step(
        logged,
        curves.read_curve(logs / "curve-candidate.log"),
        resolution=curves.printed_resolution(logs / "curve-reference.log"),
    )
    assert finding.step is None, finding
    # the Llama-style fingerprint fields, read off Megatron-LM's own argument dump
    from megatron_npu.compare import fingerprint, imports

    print_ = fingerprint.fingerprint(imports.load(logs / "curve-reference.log").metrics.config)
    assert {
        k: print_[k]
        for k in (
            "bias_linear",
            "tied_embeddings",
            "swiglu",
            "normalization",
            "position_embedding_type",
            "num_query_groups",
        )
    } == {
        "bias_linear": False,
        "tied_embeddings": False,
        "swiglu": True,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "num_query_groups": 2,
    }
