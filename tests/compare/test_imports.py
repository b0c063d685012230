"""Imported runs: a megatron-npu metrics.json / compare results.json from "another machine" (a
real compare run of this session), read as a run of a matrix that also trains locally; and every
way an import file can be bad gives an ImportedRunError naming the file (and line)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from megatron_npu.compare import command, imports
from megatron_npu.compare import matrix as m

from .minimal_matrix import DEFAULTS

TINY = """
[defaults]
num-layers = 1
hidden-size = 32
num-attention-heads = 2
seq-length = 64
micro-batch-size = 2
global-batch-size = 4
train-iters = 6
lr = 5e-3
attention-dropout = 0.0
hidden-dropout = 0.0
log-interval = 3
seed = 1234
"""


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    """A real compare output, standing for the folder copied from another machine."""
    folder = tmp_path_factory.mktemp("elsewhere")
    (folder / "m.toml").write_text(TINY + '[[run]]\nname = "a"\ndevice = "cpu"\n')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setitem(sys.modules, "megatron_npu.reports", None)
        _, status = command.run_compare(m.load(folder / "m.toml"), folder / "out")
    assert status == 0
    return folder / "out"


@pytest.mark.slow
def test_imported_runs_take_part_in_every_rule(elsewhere, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    (tmp_path / "m.toml").write_text(
        TINY.replace("[defaults]", '[compare]\nbaseline = "gpu"\n[defaults]')
        + f'[[run]]\nname = "gpu"\nimport = "{elsewhere / "results.json"}"\nrun = "a"\n'
        'device = "cuda"\nhardware = "8x H200"\n'
        f'[[run]]\nname = "metrics-file"\nimport = "{elsewhere / "runs" / "a" / "metrics.json"}"\n'
        '[[run]]\nname = "local"\ndevice = "cpu"\n'
    )
    document, status = command.run_compare(m.load(tmp_path / "m.toml"), tmp_path / "out")
    runs = {r["name"]: r for r in document["runs"]}
    assert runs["gpu"]["status"] == "imported" and runs["gpu"]["device"] == "cuda"
    assert runs["gpu"]["imported_from"]["kind"] == "compare-results"
    assert runs["gpu"]["imported_from"]["run"] == "a"
    assert runs["metrics-file"]["device"] == "cpu"  # the file's own device, none in the matrix
    assert runs["metrics-file"]["imported_from"]["kind"] == "metrics"
    verdicts = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    # the same configuration trained here matches the imported curve exactly
    assert verdicts[("local", "fingerprint")]["status"] == "pass"
    assert verdicts[("local", "approximate")]["status"] == "pass"
    assert "max 0.00%" in verdicts[("local", "approximate")]["detail"]
    # a cpu run is not timed against a cuda one
    perf = verdicts[("local", "performance")]
    assert perf["status"] == "not-applicable" and "device cpu (host CPU) vs cuda" in perf["detail"]
    row = next(r for r in document["table2"] if r["name"] == "gpu")
    assert row["device"] == "cuda" and row["hardware"] == "8x H200"
    assert "| gpu | cuda (8x H200) |" in (tmp_path / "out" / "table2.md").read_text()
    assert status == 0


def _error(path, run=None) -> str:
    with pytest.raises(imports.ImportedRunError) as info:
        imports.load(path, run)
    return str(info.value)


def test_missing_empty_binary_and_wrong_format_files_are_named(tmp_path):
    assert _error(tmp_path / "nope.log") == f"{tmp_path / 'nope.log'}: no such file or folder"
    empty = tmp_path / "empty.log"
    empty.write_text("\n  \n")
    assert _error(empty) == f"{empty}: empty file"
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert _error(binary).startswith(f"{binary}: not a text file (byte 0 is not UTF-8)")
    text = tmp_path / "notes.txt"
    text.write_text("training went fine\nloss 3.2\n")
    assert "neither a Megatron-LM log" in _error(text) and str(text) in _error(text)
    folder = tmp_path / "tb"
    folder.mkdir()
    assert _error(folder) == f"{folder}: no TensorBoard event file (*tfevents*) in it"


@pytest.mark.slow
def test_truncated_and_malformed_json_imports_are_named(elsewhere, tmp_path):
    real = (elsewhere / "runs" / "a" / "metrics.json").read_text()
    cut = tmp_path / "metrics.json"
    cut.write_text(real[: len(real) // 2])
    message = _error(cut)
    assert message.startswith(f"{cut}:") and "not valid JSON" in message and "truncated" in message
    line = int(message.split(":")[1])  # the line the JSON ends on
    assert line == real[: len(real) // 2].count("\n") + 1
    data = json.loads(real)
    data["steps"] = []
    cut.write_text(json.dumps(data))
    assert _error(cut) == f"{cut}: 'steps' is empty: the run logged no step"
    del data["config"]
    cut.write_text(json.dumps(data))
    assert "not a megatron-npu metrics.json" in _error(cut)
    assert "no run 'zz' in it (runs: ['a'])" in _error(elsewhere / "results.json", "zz")
    results = json.loads((elsewhere / "results.json").read_text())
    moved = tmp_path / "results.json"  # the results file without its runs/ folder
    moved.write_text(json.dumps(results))
    assert "cannot read its metrics" in _error(moved, "a")
    assert "is for a compare results.json" in _error(elsewhere / "runs" / "a" / "metrics.json", "a")


def test_a_bad_field_of_an_imported_results_file_is_named(tmp_path):
    committed = Path(__file__).resolve().parents[2] / "competitor" / "nvidia-h100" / "results.json"
    data = json.loads(committed.read_text())
    data["runs"][0]["status"] = None
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    message = _error(path, "cuda-fp32")
    assert message.startswith(f"{path}: runs[0].status: input should be a valid string")
    data["schema_version"] = 2
    path.write_text(json.dumps(data))
    assert _error(path, "cuda-fp32") == (
        f"{path}: schema_version: 2 is not supported (this version of megatron-npu reads 1)"
    )


def test_matrix_import_and_script_keys(tmp_path):
    def load(text):
        path = tmp_path / "m.toml"
        path.write_text(DEFAULTS + '[[run]]\nname = "a"\n' + text)
        return m.load(path)

    spec = load('[[run]]\nname = "g"\nimport = "logs/g.log"\nhardware = "8x H200"\n').run("g")
    assert spec.kind == "import" and spec.path == str(tmp_path / "logs" / "g.log")
    assert spec.devices == () and spec.options == {} and spec.hardware == "8x H200"
    script = load(
        '[[run]]\nname = "s"\nscript = "mlm/pretrain_gpt.py"\nargs = ["--num-layers", 2]\n'
        'nproc_per_node = 2\ndevice = "npu-emulated"\n'
    ).run("s")
    assert script.kind == "script" and script.script_args == ("--num-layers", "2")
    assert script.nproc_per_node == 2 and script.path == str(tmp_path / "mlm" / "pretrain_gpt.py")
    for text, needle in [
        (
            '[[run]]\nname = "g"\nimport = "x"\noptions = { lr = 1 }\n',
            "an imported run takes no ['options']",
        ),
        (
            '[[run]]\nname = "g"\nimport = "x"\nscript = "y"\n',
            "either import = ... or script = ...",
        ),
        ('[[run]]\nname = "g"\nrun = "x"\n', "add import = ..."),
        ('[[run]]\nname = "g"\nargs = ["x"]\n', "args belongs to a script = ... run"),
        (
            '[[run]]\nname = "g"\nscript = "y"\nnproc_per_node = 0\n',
            "nproc_per_node must be a positive integer",
        ),
        ('[[run]]\nname = "g"\nspeed_reference = "zz"\n', "speed_reference 'zz' is not a run"),
    ]:
        with pytest.raises(m.MatrixError, match=None) as info:
            load(text)
        assert needle in str(info.value), (text, str(info.value))


def test_a_script_run_is_launched_through_torchrun_and_the_adaptor(tmp_path, monkeypatch):
    from megatron_npu.compare import runner

    script = tmp_path / "Megatron-LM" / "pretrain_gpt.py"
    script.parent.mkdir()
    script.write_text("print('hello')\n")
    (tmp_path / "m.toml").write_text(
        '[[run]]\nname = "mlm"\nscript = "Megatron-LM/pretrain_gpt.py"\n'
        'args = ["--num-layers", "2", "--bf16"]\nnproc_per_node = 2\ndevice = "npu-emulated"\n'
    )
    spec = m.load(tmp_path / "m.toml").run("mlm")
    assert runner.script_command(spec) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "megatron_npu.run_script",
        str(script),
        "--num-layers",
        "2",
        "--bf16",
    ]
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = runner.script_environment(spec, "npu-emulated")
    assert env["MEGATRON_NPU_DEVICE"] == "npu-emulated"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(script.parent), "/somewhere/else"]
    # a script that logs no Megatron-LM line is a failed run naming its log, not an empty curve
    monkeypatch.setattr(runner, "script_command", lambda spec, *_: [sys.executable, str(spec.path)])
    outcome = runner.execute_script(
        spec, "npu-emulated", tmp_path / "run", timeout_s=60, session="s"
    )
    assert outcome.status == "failed"
    assert outcome.error.startswith(
        f"its log cannot be read: {tmp_path / 'run' / 'train.log'}: no argument dump"
    )
