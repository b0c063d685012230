"""The noise rule end to end: compare reruns the cpu reference with its initial weights one ulp
up and one ulp down, and judges each npu-emulated candidate against the band those reruns span.

The configuration is a Llama-style block trained at a learning rate that spikes its grad norm
in the first steps, the mechanism that turns rounding into per-cent differences. A healthy
npu-emulated candidate stays inside the band in fp32 and in bf16; the emulated ``npu_rms_norm``
kernel with its output 2 % too large (``tests/compare/plants``) leaves it in fp32."""

from __future__ import annotations

import sys

import pytest
from planting import plant_env

from megatron_npu.compare import command as compare_command
from megatron_npu.compare import matrix as m

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def matrix(precision: str, candidates: dict[str, str]) -> str:
    runs = "".join(f'[[run]]\nname = "{n}"\ndevice = "{d}"\n' for n, d in candidates.items())
    return f"""
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
train-iters = 12
lr = 1e-2
normalization = "RMSNorm"
swiglu = true
position-embedding-type = "rope"
disable-bias-linear = true
attention-dropout = 0.0
hidden-dropout = 0.0
mock-data = true
{"bf16 = true" if precision == "bf16" else ""}

[[run]]
name = "ref"
device = "cpu"

[[run]]
name = "ref-ulp-up"
rerun_of = "ref"
perturb = "init-ulp"

[[run]]
name = "ref-ulp-down"
rerun_of = "ref"
perturb = "init-ulp-down"

{runs}"""


def _compare(tmp_path, monkeypatch, precision, candidates, plant=None):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    if plant:
        for key, value in plant_env(plant).items():
            monkeypatch.setenv(key, value)
    path = tmp_path / f"{precision}.toml"
    path.write_text(matrix(precision, candidates))
    document, status = compare_command.run_compare(m.load(path), tmp_path / precision)
    verdicts = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    return document, status, verdicts


def _early_spike(document) -> None:
    """The reference's grad norm at least doubles within its first six steps and its loss
    rises at one of them: the curve amplifies rounding early."""
    ref = next(r for r in document["runs"] if r["name"] == "ref")["steps"]
    norms, losses = [s["grad_norm"] for s in ref], [s["loss"] for s in ref]
    assert max(norms[1:6]) >= 2 * norms[0], norms
    assert any(b > a for a, b in zip(losses[:6], losses[1:6], strict=False)), losses


def _healthy_inside(document, verdicts) -> None:
    band = verdicts[("npu", "noise")]
    assert band["status"] == "pass", band["detail"]
    assert band["tolerance"]["reruns"] == ["ref-ulp-down", "ref-ulp-up"]
    rows = {row["name"]: row for row in document["table2"]}
    assert rows["npu"]["noise_band"].startswith("inside"), rows["npu"]
    assert rows["ref-ulp-up"]["noise_band"] == "init-ulp rerun"


def test_fp32_healthy_inside_and_a_2_percent_kernel_bug_outside(tmp_path, monkeypatch):
    document, status, verdicts = _compare(tmp_path, monkeypatch, "fp32", {"npu": "npu-emulated"})
    _early_spike(document)
    _healthy_inside(document, verdicts)
    assert status == 0
    # the same folder: the reference and its reruns are reused, the planted candidate is new
    document, status, verdicts = _compare(
        tmp_path, monkeypatch, "fp32", {"npu-rms-2pct": "npu-emulated"}, plant="rms-norm-2pct"
    )
    # every step's loss stays within the field's 2 %; the band sees the bug from step 1
    assert max(verdicts[("npu-rms-2pct", "approximate")]["per_step"]["rel_diff"]) < 0.02
    band = verdicts[("npu-rms-2pct", "noise")]
    assert (
        band["status"] == "fail" and "outside the rounding band (first at step 1" in band["detail"]
    ), band["detail"]
    rows = {row["name"]: row for row in document["table2"]}
    assert rows["npu-rms-2pct"]["noise_band"].startswith("OUTSIDE from step 1")
    assert "OUTSIDE the rounding band" in rows["npu-rms-2pct"]["verdict"]
    assert status == 1
    # the report of this folder: the noise rule's overlay shades the band step by step, and
    # Table 2 has the rounding-band column with compare's own cell texts
    monkeypatch.undo()
    from megatron_npu.reports.build import context
    from megatron_npu.reports.inputs import load

    [comp] = context(load([tmp_path / "fp32"]))["comparisons"]
    overlay = {o["rule"]: o for o in comp["overlays"]}["noise"]
    assert overlay["step_bands"] == ["rounding band of ref"]
    assert '"name":"rounding band of ref"' in overlay["plot"]
    table = comp["table2"]
    assert table["labels"]["noise_band"] == "rounding band"
    cells = [row["noise_band"]["text"] for row in table["rows"]]
    assert cells == [r["noise_band"] or "-" for r in document["table2"]]


def test_bf16_healthy_candidate_is_inside_the_rounding_band(tmp_path, monkeypatch):
    """In bf16 one ulp of a weight is 2^-8 of it, the rounding every optimizer step applies when
    it writes the fp32 main weights back: the band is that wide (about 1 % at this size)."""
    document, status, verdicts = _compare(tmp_path, monkeypatch, "bf16", {"npu": "npu-emulated"})
    _early_spike(document)
    _healthy_inside(document, verdicts)
    assert status == 0
