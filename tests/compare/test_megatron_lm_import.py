"""Imports of Megatron-LM's own output: the logs and TensorBoard event folders in
fixtures/megatron-lm/ were written by Megatron-LM 0.16.1's unmodified pretrain_gpt.py run through
the adaptor (fixtures/megatron-lm/README.md says how); the damaged files of the error tests are
cut or altered copies of them."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import sys
from pathlib import Path

import pytest

from megatron_npu.compare import command, imports, mlm_log
from megatron_npu.compare import matrix as m

FIXTURES = Path(__file__).with_name("fixtures") / "megatron-lm"
TP2_LOG = FIXTURES / "tp2-cpu.log"
EMU_LOG = FIXTURES / "tp2-npu-emulated.log"
FP16_LOG = FIXTURES / "fp16-cpu.log"
TP2_EVENTS = FIXTURES / "tb-tp2-cpu"
FP16_EVENTS = FIXTURES / "tb-fp16-cpu"


def _iteration_lines(path: Path) -> list[tuple[int, str]]:
    return [
        (n, line)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if mlm_log.ITERATION.search(line)
    ]


def test_a_real_log_parses_with_its_arguments_and_every_step():
    parsed = mlm_log.parse(TP2_LOG)
    args = parsed["arguments"]
    assert args["num_layers"] == 2 and args["tensor_model_parallel_size"] == 2
    assert args["world_size"] == 2 and args["mock_data"] is True and args["lr"] == 0.001
    assert args["tokenizer_type"] == "NullTokenizer" and args["data_path"] is None
    assert parsed["padded_vocab_size"] == 1280
    lines = _iteration_lines(TP2_LOG)
    assert (
        [r["iteration"] for r in parsed["iterations"]]
        == list(range(1, 13))
        == [int(re.search(r"iteration\s+(\d+)/", line).group(1)) for _, line in lines]
    )
    first = parsed["iterations"][0]
    assert first["lm_loss"] == 7.168857 and first["grad_norm"] == 0.8
    assert first["step_time_ms"] == 310.5 and first["skipped"] == 0
    assert parsed["peak_allocated_mb"] > 0  # the memory report lines (max allocated)


def test_skipped_fp16_steps_have_no_loss():
    metrics = imports.load(FP16_LOG).metrics.model_dump()
    skipped = [s for s in metrics["steps"] if s["skipped"]]
    assert skipped and all(s["lm_loss"] is None for s in skipped)
    assert metrics["steps"][0]["loss_scale"] == 2.0**32
    assert metrics["config"]["arguments"]["fp16"] is True


def test_the_event_folder_matches_the_log_of_the_same_run():
    events = imports.load(TP2_EVENTS)
    log = imports.load(TP2_LOG)
    assert (
        events.provenance["kind"] == "tensorboard" and log.provenance["kind"] == "megatron-lm-log"
    )
    e_steps, l_steps = events.metrics.model_dump()["steps"], log.metrics.model_dump()["steps"]
    assert [s["step"] for s in e_steps] == [s["step"] for s in l_steps]
    # TensorBoard holds each step's loss; the log prints %.6E of it -- its second line the mean of
    # the first two iterations (Megatron-LM 0.16+), which the importer takes back apart: step 2
    # is two printed values apart from TensorBoard's
    for e, line in zip(e_steps, l_steps, strict=True):
        if e["step"] != 2:
            assert f"{e['lm_loss']:.6E}" == f"{line['lm_loss']:.6E}"
    assert l_steps[1]["lm_loss"] == pytest.approx(e_steps[1]["lm_loss"], rel=1.5e-6)
    assert [round(s["grad_norm"], 3) for s in e_steps] == [s["grad_norm"] for s in l_steps]
    assert events.metrics.config.arguments["num_layers"] == 2  # from the text summaries
    assert events.metrics.config.padded_vocab_size == 1280


def test_several_ranks_prefixed_and_repeated_lines_parse_alike(tmp_path):
    prefixed = tmp_path / "ranks.log"
    out = []
    for line in TP2_LOG.read_text().splitlines():
        out.append(f"[rank1]: {line}")
        if mlm_log.ITERATION.search(
            line
        ):  # both ranks print it (e.g. a PP run's logs concatenated)
            out.append(f"[rank0]: {line}")
    prefixed.write_text("\n".join(out) + "\n")
    assert mlm_log.parse(prefixed) == mlm_log.parse(TP2_LOG)


def _error(path: Path) -> str:
    with pytest.raises(imports.ImportedRunError) as info:
        imports.load(path)
    return str(info.value)


def test_truncated_corrupt_and_wrong_logs_are_named_with_their_line(tmp_path):
    text = TP2_LOG.read_text()
    lines = text.splitlines()
    (number, line), *_ = _iteration_lines(TP2_LOG)[5:]
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(lines[: number - 1] + [line[: len(line) // 2]]) + "\n")
    assert _error(cut) == (
        f"{cut}:{number}: iteration line cut short "
        "(no 'number of skipped iterations' field): truncated log?"
    )
    start = next(n for n, x in enumerate(lines, 1) if mlm_log.ARGS_START.search(x))
    cut.write_text("\n".join(lines[: start + 20]) + "\n")
    assert _error(cut) == f"{cut}:{start}: the argument dump never ends: truncated log?"
    cut.write_text("\n".join(lines[start + 700 :]) + "\n")  # the start of the log lost
    assert "no argument dump" in _error(cut) and _error(cut).startswith(f"{cut}: ")
    end = next(n for n, x in enumerate(lines, 1) if mlm_log.ARGS_END.search(x))
    undotted = lines[:start] + [x.strip() for x in lines[start : end - 1]]
    cut.write_text("\n".join(undotted + lines[end - 1 :]) + "\n")  # a dump in another layout
    assert _error(cut) == (
        f"{cut}:{start}: the argument dump holds no line that reads as Megatron-LM's "
        "'  name ....... value'"
    )
    cut.write_text("\n".join(lines[:end]) + "\n")  # killed before its first step
    assert "no 'iteration N/ M | ...' lines" in _error(cut)
    corrupt = tmp_path / "corrupt.log"
    corrupt.write_text(text.replace("lm loss: 7.168857E+00", "lm loss: 7.16#857E+00", 1))
    first = _iteration_lines(TP2_LOG)[0][0]
    assert _error(corrupt) == f"{corrupt}:{first}: 'lm loss' is not a number: '7.16#857E+00'"
    twice = tmp_path / "twice.log"
    twice.write_text(text + EMU_LOG.read_text())  # two runs' logs in one file
    message = _error(twice)
    assert re.fullmatch(
        rf"{re.escape(str(twice))}:\d+: iteration 1 is logged again with other figures "
        rf"than at line {first} \(two runs in one log\?\)",
        message,
    ), message


def test_damaged_event_files_are_named(tmp_path):
    [original] = TP2_EVENTS.iterdir()
    data = original.read_bytes()
    for name, damaged in {
        "cut": data[: len(data) - 700],  # the last records lost: would be a silently short curve
        "flipped": data[:20000] + bytes(b ^ 0xFF for b in data[20000:20040]) + data[20040:],
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / original.name).write_bytes(damaged)
        message = _error(folder)
        assert (
            message.startswith(f"{folder / original.name}: record ")
            and "truncated or corrupt" in message
        )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / original.name).write_bytes(b"")
    assert _error(empty) == f"{empty / original.name}: empty event file"
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(original, other / original.name)
    assert imports.load(other).metrics.summary.steps == 12  # the copy itself is fine


@pytest.mark.slow
def test_imported_megatron_lm_runs_against_a_local_emulated_run(tmp_path, monkeypatch):
    """Megatron-LM's own runs imported beside one trained here: its TP2 log (cpu) as the
    baseline, its npu-emulated log, its event folder, and the same configuration trained here on
    the NPU code path: one Table 2 with every row, approximate verdicts, and no speed verdict on
    emulated rows."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    (tmp_path / "m.toml").write_text(f"""
[compare]
baseline = "mlm-cpu"
# megatron-npu train is another program than pretrain_gpt.py (its weights and dropout draws are
# its own): its loss stays within 0.3 % of Megatron-LM's, its grad norm wanders 12 % off at a
# late step, beyond the field's 10 %
grad_norm_rtol = 0.2

[defaults]   # the runs' pretrain_gpt.py arguments (fixtures/megatron-lm/README.md)
num-layers = 2
hidden-size = 64
num-attention-heads = 4
seq-length = 128
max-position-embeddings = 128
micro-batch-size = 2
global-batch-size = 4
train-iters = 12
lr = 1e-3
lr-decay-style = "linear"
weight-decay = 0.01
mock-data = true
vocab-size = 1024
log-interval = 1

[[run]]
name = "mlm-cpu"
import = "{TP2_LOG}"
device = "cpu"
hardware = "Megatron-LM 0.16.1 pretrain_gpt.py, 2 ranks"

[[run]]
name = "mlm-npu-emulated"
import = "{EMU_LOG}"
device = "npu-emulated"

[[run]]
name = "mlm-events"
import = "{TP2_EVENTS}"
device = "cpu"

[[run]]
name = "npu-tp2"
device = "npu-emulated"
options = {{ nproc-per-node = 2, tensor-model-parallel-size = 2 }}
""")
    echo = io.StringIO()
    with contextlib.redirect_stdout(echo):
        document, status = command.run_compare(m.load(tmp_path / "m.toml"), tmp_path / "out")
    verdicts = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    for name in ("mlm-npu-emulated", "mlm-events", "npu-tp2"):
        assert (name, "fingerprint") in verdicts, echo.getvalue()
        assert verdicts[(name, "fingerprint")]["status"] == "pass", verdicts[(name, "fingerprint")]
        assert verdicts[(name, "approximate")]["status"] == "pass", verdicts[(name, "approximate")]
    for name in ("mlm-npu-emulated", "npu-tp2"):
        perf = verdicts[(name, "performance")]
        assert perf["status"] == "not-applicable" and "emulated" in perf["detail"]
    assert verdicts[("mlm-events", "performance")]["detail"] == "no step times to compare"
    rows = {r["name"]: r for r in document["table2"]}
    assert set(rows) == {"mlm-cpu", "mlm-npu-emulated", "mlm-events", "npu-tp2"}
    assert (
        rows["mlm-cpu"]["hardware"].startswith("Megatron-LM")
        and rows["mlm-cpu"]["layout"] == "TP2 PP1 DP1"
    )
    assert rows["npu-tp2"]["mfu"] is None and rows["mlm-npu-emulated"]["emulated"] is True
    # Megatron-LM's 'max allocated' of a run on cpu is what the adaptor's cpu device measures:
    # the process's peak RSS, so it goes in the RSS column
    assert rows["mlm-cpu"]["peak_rss_mib"] > 0 and rows["mlm-cpu"]["peak_allocated_mib"] is None
    # the adaptor's own run on the host has both: the allocator's peak (profiled) and its RSS
    local = rows["npu-tp2"]
    assert 0 < local["peak_allocated_mib"] < local["peak_rss_mib"]
    header = (tmp_path / "out" / "table2.md").read_text().splitlines()[2]
    assert "peak RSS MiB" in header and "cloze" not in header  # no run was evaluated
    runs = {r["name"]: r for r in document["runs"]}
    assert runs["mlm-cpu"]["imported_from"]["kind"] == "megatron-lm-log"
    assert runs["mlm-cpu"]["imported_from"]["sha256"]
    assert status == 0, echo.getvalue()[-3000:]
