"""The native H100 runs of ``../shared/gpu-logs`` (Megatron-LM core_v0.16.1's ``pretrain_gpt.py``,
unmodified) imported as compare runs: model FLOPs from the log's own throughput field agree with
Megatron-LM's formula over its argument dump, and the MFU reads against the datasheet peak of the
GPU the matrix's ``hardware`` label names."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest

from megatron_npu.compare import command, datasheet, imports, mlm_log
from megatron_npu.compare import matrix as m
from megatron_npu.compare.fingerprint import fingerprint
from megatron_npu.training import flops

GPU_LOGS = Path(__file__).resolve().parents[3] / "shared" / "gpu-logs"
GPT345M = GPU_LOGS / "h100-gpt345m"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_logged_throughput_and_the_formula_count_the_same_flops(precision):
    log = GPT345M / f"mlm-native-{precision}.log"
    parsed = mlm_log.parse(log)
    assert any(r.get("tflops_per_gpu") for r in parsed["iterations"])
    logged = imports.load(log).metrics.summary.model_flops_per_step
    formula = flops.model_flops_per_step(parsed["arguments"], parsed["padded_vocab_size"])
    # the log prints TFLOP/s with one decimal: about 0.1 % at 30-90 TFLOP/s
    assert logged == pytest.approx(formula, rel=2e-3)
    assert formula == pytest.approx(3.72e13, rel=1e-3)  # 345M, 16 x 1024 tokens


def test_a_log_without_throughput_counts_by_the_formula():
    log = GPU_LOGS / "h100-tiny" / "gpt-fp32.log"
    parsed = mlm_log.parse(log)
    assert not any(r.get("tflops_per_gpu") for r in parsed["iterations"])
    summary = imports.load(log).metrics.summary
    # 4 layers, h 256, s 256, vocab 1024, batch 8: 12 B s L h^2 (1 + 1 + s/2h + 4 + V/2Lh)
    expected = 12 * 8 * 256 * 4 * 256**2 * (1 + 1 + 256 / 256 * 0.5 + 4 + 1024 / (2 * 4 * 256))
    assert summary.model_flops_per_step == pytest.approx(expected, rel=1e-12)


def test_datasheet_peaks_follow_the_label_and_the_precision():
    assert datasheet.peak("H100 SXM", "bf16") == (989.0, "H100 SXM datasheet, dense bf16")
    assert datasheet.peak("8x h100", "fp32")[0] == 67.0
    assert datasheet.peak("H100 PCIe 80GB", "fp16")[0] == 756.0
    assert datasheet.peak("A100-SXM4-80GB", "fp32")[0] == 19.5
    assert datasheet.peak("Ascend 910B", "bf16") is None and datasheet.peak(None, "bf16") is None


def test_imported_h100_runs_get_their_mfu_against_the_datasheet(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    matrix = tmp_path / "m.toml"
    matrix.write_text(
        '[compare]\nbaseline = "fp32"\n'
        f'[[run]]\nname = "fp32"\nimport = "{GPT345M / "mlm-native-fp32.log"}"\ndevice = "cuda"\n'
        'hardware = "H100 SXM"\n'
        f'[[run]]\nname = "bf16"\nimport = "{GPT345M / "mlm-native-bf16.log"}"\ndevice = "cuda"\n'
        'hardware = "H100 SXM"\n'
    )
    document, _ = command.run_compare(m.load(matrix), tmp_path / "out")
    runs = {r["name"]: r for r in document["runs"]}
    for name, peak in (("fp32", 67.0), ("bf16", 989.0)):
        perf = runs[name]["perf"]
        assert perf["peak_tflops"] == peak and perf["peak_source"] == "datasheet"
        expected = perf["model_flops_per_step"] / perf["median_s_per_step"] / (peak * 1e12)
        assert perf["mfu"] == pytest.approx(expected, rel=1e-9)
    # the README's figures: bf16 0.389 s/step (about 96 TFLOP/s, ~10 % of 989), fp32 1.181 s/step
    assert runs["bf16"]["perf"]["median_s_per_step"] == pytest.approx(0.389, rel=0.05)
    assert runs["bf16"]["perf"]["mfu"] == pytest.approx(96 / 989, rel=0.05)
    assert runs["fp32"]["perf"]["mfu"] == pytest.approx(31.5 / 67, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_event_folder_counts_the_flops_its_log_counts(precision):
    """The H100 runs' TensorBoard folders (``throughput`` and ``iteration-time`` scalars) give the
    step's model FLOPs their console logs give, and so the same MFU."""
    from megatron_npu.compare import imports

    log = imports.load(str(GPT345M / f"mlm-native-{precision}.log")).metrics.summary
    events = imports.load(str(GPT345M / f"mlm-native-{precision}-tb")).metrics.summary
    assert events.model_flops_per_step == pytest.approx(log.model_flops_per_step, rel=1e-3)


def _cluster_prefixes(line: str, number: int) -> dict[str, str]:
    """The line as cluster launchers and loggers write it: Slurm's ``srun --label``, pdsh's host
    prefix before it, OpenMPI's ``--tag-output``, a per-line timestamp of fixed and of varying
    width (a logging handler's)."""
    return {
        "srun-label": f"0: {line}",
        "pdsh": f"gpu-node-07: 0: {line}",
        "openmpi-tag": f"[1,0]<stdout>:{line}",
        "iso-timestamp": f"2026-11-29T05:{number % 60:02d}:00.{number % 1000:03d}Z {line}",
        "logging": f"2026-11-29 5:{number % 60}:{number % 7} INFO {line}",
    }


@pytest.mark.parametrize("launcher", list(_cluster_prefixes("", 0)))
def test_a_log_with_each_line_prefixed_reads_as_the_plain_log(tmp_path, launcher):
    """Every argument of the dump is read (an empty value and the names longer than the dots'
    48 columns too) and every iteration, so the fingerprint and 0.16's first-line sums come out
    as from the plain log."""
    log = GPU_LOGS / "h100-tiny" / "gpt-fp32.log"
    lines = log.read_text().splitlines()
    prefixed = tmp_path / f"{launcher}.log"
    prefixed.write_text(
        "".join(_cluster_prefixes(line, n)[launcher] + "\n" for n, line in enumerate(lines))
    )
    start = next(n for n, x in enumerate(lines) if "-- arguments --" in x)
    end = next(n for n, x in enumerate(lines) if "-- end of arguments --" in x)
    dumped = {x.split()[0] for x in lines[start + 1 : end]}
    plain, read = mlm_log.parse(log), mlm_log.parse(prefixed)
    assert set(read["arguments"]) == set(plain["arguments"]) == dumped
    assert read["arguments"]["config_logger_dir"] == ""
    assert read == plain
    configs = [imports.load(path).metrics.config for path in (prefixed, log)]
    assert fingerprint(configs[0]) == fingerprint(configs[1])


def test_an_archived_gzip_log_reads_as_the_log(tmp_path):
    log = GPU_LOGS / "h100-tiny" / "gpt-bf16.log"
    archived = tmp_path / "gpt-bf16.log.gz"
    archived.write_bytes(gzip.compress(log.read_bytes()))
    assert mlm_log.parse(archived) == mlm_log.parse(log)
    assert imports.load(archived).metrics.steps == imports.load(log).metrics.steps
    damaged = tmp_path / "cut.log.gz"
    damaged.write_bytes(archived.read_bytes()[:2000])
    with pytest.raises(imports.ImportedRunError, match=r"cut\.log\.gz: a damaged gzip file \("):
        imports.load(damaged)
