"""Dump on one machine, compare on another: the reference dump is a self-contained folder (its
checkpoint included) that a second ``locate`` reads from wherever it was copied to."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_npu.cli import main
from megatron_npu.formats.locate_result import LocateResult

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 4 --lr 1e-3 --lr-warmup-iters 1 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --seed 7 --normalization RMSNorm "
    "--layout-independent-init"
)


def test_a_reference_dump_taken_elsewhere_locates_the_bug(tmp_path):
    common = f"{TINY} --default-corpus-dir {tmp_path / 'corpus'}"
    there = tmp_path / "machine-a"
    code = main(
        [
            "locate",
            "--common",
            common,
            "--reference",
            "--device cpu",
            "--candidate",
            "--device npu-emulated",
            "--step",
            "2",
            "--dump-only",
            "--out",
            str(there),
        ]
    )
    assert code == 0
    meta = json.loads((there / "dumps" / "reference" / "locate-dump.json").read_text())
    assert meta["format"] == "megatron-npu-locate-dump" and meta["step"] == 2
    assert (there / "dumps" / "reference" / "checkpoint").is_dir()
    located = LocateResult.read(there / "locate.json")
    assert located.modules == [] and located.dumps.candidate is None
    copied = tmp_path / "carried" / "reference"
    shutil.copytree(there / "dumps" / "reference", copied)
    shutil.rmtree(there)  # nothing of machine A's folder is read by machine B
    here = tmp_path / "machine-b"
    code = main(
        [
            "locate",
            "--common",
            common,
            "--reference",
            "--device cpu",
            "--candidate",
            "--device cpu",
            "--plant-candidate",
            "rmsnorm-wrong-eps",
            "--step",
            "2",
            "--reference-dump",
            str(copied),
            "--out",
            str(here),
        ]
    )
    assert code == 0
    data = LocateResult.read(here / "locate.json")
    assert data.replayed_step == 2
    assert data.divergent.module == "decoder.layers.0.input_layernorm"
    assert data.culprit.culprits == ["norm.wrapped-torch-norm"]
    # a dump of another step is refused by name
    code = main(
        [
            "locate",
            "--common",
            common,
            "--reference",
            "--device cpu",
            "--candidate",
            "--device cpu",
            "--step",
            "3",
            "--reference-dump",
            str(copied),
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert code == 2
