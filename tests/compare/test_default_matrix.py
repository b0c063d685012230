"""The shipped default matrix on real runs: on a healthy tree its rules end without a ``fail``;
a slowdown planted in the adaptor's CPU attention fails the like-for-like speed pair, and an
accuracy bug planted in the emulated NPU AdamW kernel fails the approximate rule -- each with exit
status 1. The bugs are planted in the train subprocesses by ``plants/sitecustomize.py``.

The runs are the default matrix's own entries (same options, same rules and thresholds), only
the rows a bug touches, without the cloze evaluation, to keep the time down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from planting import plant_env

from megatron_npu.compare import command
from megatron_npu.compare import matrix as m

pytestmark = pytest.mark.slow


def _default_rows(*names: str) -> m.Matrix:
    default = m.load(None)
    return dataclasses.replace(
        default,
        settings=dataclasses.replace(default.settings, lambada=False),
        runs=tuple(r for r in default.runs if r.name in names),
    )


def _compare(tmp_path: Path, monkeypatch, plant: str | None, *names: str):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if plant:
        for key, value in plant_env(plant).items():
            monkeypatch.setenv(key, value)
    monkeypatch.setitem(__import__("sys").modules, "megatron_npu.reports", None)
    return command.run_compare(_default_rows(*names), tmp_path / "out")


def _verdicts(document) -> dict[tuple[str, str], dict]:
    return {(v["candidate"], v["rule"]): v for v in document["verdicts"]}


def test_healthy_tree_has_no_fail(tmp_path, monkeypatch):
    document, status = _compare(
        tmp_path, monkeypatch, None, "ref-fp32", "cpu-fp32-flash", "npu-fp32"
    )
    verdicts = _verdicts(document)
    assert status == 0, [v for v in verdicts.values() if v["status"] != "pass"]
    assert not [v for v in verdicts.values() if v["status"] in ("fail", "refused")]
    # the one like-for-like speed pair was timed; the emulated row was not
    assert verdicts[("cpu-fp32-flash", "performance")]["status"] == "pass"
    assert verdicts[("npu-fp32", "performance")]["status"] == "not-applicable"


def _rows_alone(tmp_path, monkeypatch, *names: str) -> dict[tuple[str, str], dict]:
    """Run the default matrix's rows ``names`` by themselves, the first as the baseline (so the
    local-spec dense baseline is not rerun); their verdicts, every one a pass."""
    rows = _default_rows(*names)
    rows = dataclasses.replace(
        rows,
        settings=dataclasses.replace(rows.settings, baseline=names[0]),
        runs=tuple(
            dataclasses.replace(r, reference=None, judged=False) if r.name == names[0] else r
            for r in rows.runs
        ),
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(__import__("sys").modules, "megatron_npu.reports", None)
    document, status = command.run_compare(rows, tmp_path / "out")
    verdicts = _verdicts(document)
    assert status == 0, [v for v in verdicts.values() if v["status"] != "pass"]
    return verdicts


@pytest.mark.extended
def test_te_spec_rows_pass_their_rules(tmp_path, monkeypatch):
    """The Transformer Engine spec on the reference path and the NPU path agree by the
    approximate rule, and its TP2 and CP2 runs agree with its one-rank run by the layout rule."""
    verdicts = _rows_alone(
        tmp_path, monkeypatch, "ref-fp32-te", "npu-fp32-te", "npu-fp32-te-tp2", "npu-fp32-te-cp2"
    )
    assert verdicts[("npu-fp32-te", "approximate")]["status"] == "pass"
    assert verdicts[("npu-fp32-te-tp2", "layout")]["status"] == "pass"
    assert verdicts[("npu-fp32-te-cp2", "layout")]["status"] == "pass"


@pytest.mark.extended
def test_moe_rows_pass_their_rules(tmp_path, monkeypatch):
    """The mixture-of-experts rows: the reference path and the NPU path agree by the approximate
    rule, and the EP2 run agrees with the EP1 run by the layout rule."""
    verdicts = _rows_alone(
        tmp_path, monkeypatch, "ref-fp32-moe", "npu-fp32-moe", "npu-fp32-moe-ep2"
    )
    assert verdicts[("npu-fp32-moe", "approximate")]["status"] == "pass"
    assert verdicts[("npu-fp32-moe-ep2", "layout")]["status"] == "pass"


@pytest.mark.extended
def test_planted_slowdown_fails_the_default_matrix(tmp_path, monkeypatch):
    document, status = _compare(
        tmp_path, monkeypatch, "slow-attention", "ref-fp32", "cpu-fp32-flash"
    )
    verdicts = _verdicts(document)
    perf = verdicts[("cpu-fp32-flash", "performance")]
    assert perf["status"] == "fail", perf["detail"]
    assert verdicts[("cpu-fp32-flash", "approximate")]["status"] == "pass"  # right results, slow
    assert status == 1


def test_planted_accuracy_bug_fails_the_default_matrix(tmp_path, monkeypatch):
    document, status = _compare(tmp_path, monkeypatch, "wrong-adamw", "ref-fp32", "npu-fp32")
    verdict = _verdicts(document)[("npu-fp32", "approximate")]
    assert verdict["status"] == "fail", verdict["detail"]
    assert status == 1
