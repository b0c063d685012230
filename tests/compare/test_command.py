"""The compare command's orchestration with a stand-in runner (no training): failures, outputs,
verdict selection, the Table 2 file and the optional report call."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types

import numpy as np
import pytest

from megatron_npu.compare import command, judging, runner
from megatron_npu.compare import matrix as m
from megatron_npu.formats.metrics import MetricsFile

from .minimal_matrix import DEFAULTS

MATRIX = (
    '[compare]\nbaseline = "ref"\n'
    + DEFAULTS
    + """layout-independent-init = true
[[run]]
name = "ref"
device = "cpu"
[[run]]
name = "ref-rerun"
rerun_of = "ref"
[[run]]
name = "emu"
device = ["npu", "npu-emulated"]
[[run]]
name = "emu-tp2"
device = "npu-emulated"
reference = "emu"
options = { nproc-per-node = 2, tensor-model-parallel-size = 2 }
[[run]]
name = "broken"
device = "cpu"
options = { lr = 0.5 }
[[run]]
name = "gpu"
device = "cuda"
optional = true
"""
)


def _metrics(spec, device, losses):
    args = {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 256,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "seq_length": 128,
        "max_position_embeddings": 128,
        "seed": 1234,
        "global_batch_size": 8,
        "tensor_model_parallel_size": spec.tensor_parallel,
        "pipeline_model_parallel_size": 1,
        "init_method_std": 0.02,
    }
    steps = [
        {
            "step": i + 1,
            "lm_loss": loss,
            "grad_norm": 1.0 / (i + 1),
            "skipped": False,
            "step_time_s": 0.1,
        }
        for i, loss in enumerate(losses)
    ]
    summary = {
        "first_lm_loss": losses[0],
        "last_lm_loss": losses[-1],
        "model_flops_per_step": 1e9,
        "peak": {"tflops": 0.05, "source": "user"},
        "peak_devices": 1,
        "peak_memory_bytes": 100 * 2**20,
    }
    config = {
        "arguments": args,
        "padded_vocab_size": 512,
        "device": device,
        "device_emulated": device == "npu-emulated",
        "world_size": spec.tensor_parallel,
        "data": {
            "source": "default-corpus",
            "description": "corpus /x/stdlib_docs_ab_text_document, vocab 257",
        },
    }
    return {"config": config, "steps": steps, "summary": summary}


@pytest.fixture
def fake_runs(monkeypatch):
    """execute() writes a synthetic metrics.json; 'broken' fails as a killed run would."""
    calls = []

    def execute(spec, device, run_dir, **kwargs):
        calls.append(spec.name)
        if spec.name == "broken":
            return runner.Outcome("failed", "killed after the 5 s timeout", 5.0, ["train"], "h")
        losses = list(np.linspace(6, 3, 12))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.json").write_text(json.dumps(_metrics(spec, device, losses)))
        return runner.Outcome("ok", None, 1.0, ["train", spec.name], "h", session=kwargs["session"])

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "device_available", lambda name: name in ("cpu", "npu-emulated"))
    return calls


def _run(tmp_path, monkeypatch, reports_module):
    if reports_module is None:
        monkeypatch.setitem(
            sys.modules, "megatron_npu.reports", None
        )  # import reports -> ImportError
    else:
        monkeypatch.setitem(sys.modules, "megatron_npu.reports", reports_module)
    path = tmp_path / "m.toml"
    path.write_text(MATRIX)
    echo = io.StringIO()
    with contextlib.redirect_stdout(echo):
        document, status = command.run_compare(m.load(path), tmp_path / "out", argv=["compare"])
    return document, status, echo.getvalue()


def test_a_failed_run_is_reported_and_the_others_complete(tmp_path, monkeypatch, fake_runs):
    document, status, printed = _run(tmp_path, monkeypatch, None)
    assert fake_runs == ["ref", "ref-rerun", "emu", "emu-tp2", "broken"]
    runs = {r["name"]: r for r in document["runs"]}
    assert runs["broken"]["status"] == "failed" and "timeout" in runs["broken"]["error"]
    assert all(runs[n]["status"] == "ok" for n in ("ref", "ref-rerun", "emu", "emu-tp2"))
    assert status == 1  # a failed run fails the comparison, after everything else ran
    assert document["skipped"] == [
        {"name": "gpu", "reason": "none of its devices (cuda) is available here"}
    ]
    rules_by_candidate = {(v["candidate"], v["rule"]): v["status"] for v in document["verdicts"]}
    assert rules_by_candidate[("ref-rerun", "deterministic")] == "pass"
    assert rules_by_candidate[("emu", "approximate")] == "pass"
    assert rules_by_candidate[("emu-tp2", "layout")] == "pass"
    assert rules_by_candidate[("emu", "performance")] == "not-applicable"
    assert runs["emu"]["device"] == "npu-emulated" and runs["emu"]["emulated"] is True
    assert runs["emu"]["perf"]["speed_comparable"] is False
    assert runs["ref"]["perf"]["mfu"] == pytest.approx(1e9 / 0.1 / 0.05e12)
    # the MFU interval is the s/step interval turned around
    slow, fast = runs["ref"]["perf"]["ci95_s_per_step"][::-1]
    assert runs["ref"]["perf"]["ci95_mfu"] == pytest.approx(
        [1e9 / slow / 0.05e12, 1e9 / fast / 0.05e12]
    )
    table = (tmp_path / "out" / "table2.md").read_text()
    assert "| emu | npu-emulated* |" in table and "not NPU performance" in table
    assert "run failed: killed after the 5 s timeout" in table
    assert "no report.html: the `reports` package is not importable" in printed
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["schema"] == "megatron-npu/compare" and on_disk["schema_version"] == 1
    assert {row["name"] for row in on_disk["table2"]} == {
        "ref",
        "ref-rerun",
        "emu",
        "emu-tp2",
        "broken",
    }


def test_the_report_is_built_when_the_reports_package_imports(tmp_path, monkeypatch, fake_runs):
    seen = []

    def build_report(inputs, output, *, diff_base=None):
        seen.append((list(inputs), output))
        output.write_text("<html></html>")
        return output

    _, _, printed = _run(tmp_path, monkeypatch, types.SimpleNamespace(build_report=build_report))
    out = tmp_path / "out"
    assert seen == [([out], out / "report.html")]
    assert f"report: {out / 'report.html'}" in printed


def test_a_like_for_like_slowdown_fails_and_unlike_pairs_are_not_timed(tmp_path, monkeypatch):
    def execute(spec, device, run_dir, **kwargs):
        metrics = _metrics(spec, device, list(np.linspace(6, 3, 12)))
        metrics["config"]["arguments"]["bf16"] = bool(spec.options.get("bf16"))
        fast = spec.name == "ref" or (spec.name == "flaky" and run_dir.name == "retime")
        for i, step in enumerate(metrics["steps"]):
            step["step_time_s"] = (0.1 if fast else 0.3) + 0.001 * (i % 3)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        session = "earlier" if spec.name == "other-session" else kwargs["session"]
        return runner.Outcome("ok", None, 1.0, ["train"], "h", session=session)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    path = tmp_path / "m.toml"
    path.write_text(
        DEFAULTS + '[[run]]\nname = "ref"\n[[run]]\nname = "bf16"\noptions = { bf16 = true }\n'
        '[[run]]\nname = "bf16-named"\noptions = { bf16 = true }\nspeed_reference = "ref"\n'
        '[[run]]\nname = "other-session"\nspeed_reference = "ref"\noptions = { bf16 = true }\n'
        '[[run]]\nname = "flaky"\nspeed_reference = "ref"\noptions = { lr = 2e-3 }\n'
    )
    document, status = command.run_compare(m.load(path), tmp_path / "out")
    perf = {v["candidate"]: v for v in document["verdicts"] if v["rule"] == "performance"}
    # bf16 against fp32 is not like for like: not timed, with the reason
    assert perf["bf16"]["status"] == "not-applicable"
    assert "precision bf16 vs fp32" in perf["bf16"]["detail"]
    # the same pair named in speed_reference is timed, and 3x slower fails the comparison
    assert perf["bf16-named"]["status"] == "fail" and "2.98x" in perf["bf16-named"]["detail"]
    # a slowdown stands only when both runs, timed again back to back, show it again
    assert "; confirmed back to back (medians 2.98x): " in perf["bf16-named"]["detail"]
    assert perf["flaky"]["status"] == "pass"
    assert perf["flaky"]["detail"].startswith("not confirmed: first timing slower than ref")
    assert document["table2"][2]["verdict"].endswith("; SLOWER")
    assert not document["table2"][1]["verdict"].endswith("; SLOWER")
    # a run reused from an earlier invocation was timed under another load: not timed against
    assert perf["other-session"]["status"] == "not-applicable"
    assert "not timed in the same compare invocation" in perf["other-session"]["detail"]
    assert status == 1


def test_the_memory_profiled_step_is_never_timed():
    """A host run's first step ran under the profiler: even with no warm-up asked for, it stays
    out of the s/step statistics; a run without a profiled step keeps every step."""
    spec = m.RunSpec(name="cpu", devices=("cpu",), options={})
    metrics = _metrics(types.SimpleNamespace(tensor_parallel=1), "cpu", [5.0, 4.9, 4.8, 4.7])
    metrics["steps"][0]["step_time_s"] = 10.0  # the profiled step, far slower
    outcome = runner.Outcome("ok", 0, 1.0, [], "")
    profiled = dict(metrics, summary={**metrics["summary"], "peak_memory_profiled_step": 1})
    record = judging.perf_record(
        judging.RunResult(spec, "cpu", outcome, metrics=MetricsFile.parse(profiled)), 0
    )
    assert record["median_s_per_step"] == pytest.approx(0.1)
    unprofiled = judging.perf_record(
        judging.RunResult(spec, "cpu", outcome, metrics=MetricsFile.parse(metrics)), 0
    )
    assert unprofiled["ci95_s_per_step"][1] > 0.1  # the slow first step is in the statistics


def test_a_pair_of_two_models_gets_no_speed_verdict(tmp_path, monkeypatch):
    """A candidate timed against another model (here another depth) is not timed at all: its
    fingerprint is refused against its reference, and its speed against its speed reference is
    not like for like (two dense runs of one precision would otherwise be timed)."""

    def execute(spec, device, run_dir, **kwargs):
        metrics = _metrics(spec, device, list(np.linspace(6, 3, 12)))
        metrics["config"]["arguments"]["num_layers"] = spec.options.get("num-layers", 2)
        if spec.name == "deep":
            for step in metrics["steps"]:
                step["step_time_s"] = 0.3  # three times slower: a verdict would fail it
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        return runner.Outcome("ok", None, 1.0, ["train", spec.name], "h", session=kwargs["session"])

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "device_available", lambda name: name == "cpu")
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    path = tmp_path / "m.toml"
    path.write_text(
        DEFAULTS + '[compare]\nbaseline = "ref"\n[[run]]\nname = "ref"\ndevice = "cpu"\n[[run]]\n'
        'name = "deep"\ndevice = "cpu"\nspeed_reference = "ref"\noptions = { num-layers = 4 }\n'
    )
    document, status = command.run_compare(m.load(path), tmp_path / "out")
    verdicts = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    assert verdicts[("deep", "fingerprint")]["status"] == "refused"
    perf = verdicts[("deep", "performance")]
    assert perf["status"] == "not-applicable", perf
    assert "another model than ref" in perf["detail"] and "num_layers (2 vs 4)" in perf["detail"]


def test_the_layout_rule_needs_layout_independent_weights_on_both_sides():
    """Megatron-LM's initial weights depend on the layout (train's default): a TP2 run is then
    another draw of the model, judged as such (approximate); with the layout-independent ones
    on both sides it is the same model computed two ways (layout, within 1e-5)."""

    def result(name, **options):
        spec = m.RunSpec(name=name, devices=("cpu",), options=options)
        return judging.RunResult(spec, "cpu", None)

    tp2 = {"nproc-per-node": 2, "tensor-model-parallel-size": 2}
    same = {"layout-independent-init": True}
    assert judging.accuracy_rule(result("b", **tp2, **same), result("a", **same)) == "layout"
    assert judging.accuracy_rule(result("b", **tp2), result("a")) == "approximate"
    assert judging.accuracy_rule(result("b", **tp2, **same), result("a")) == "approximate"
