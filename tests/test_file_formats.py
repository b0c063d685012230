"""The file formats (``megatron_npu.formats``): the JSON Schemas in ``docs/schemas/`` are the
ones the models generate, and a file that does not fit is one error naming the file and field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_npu.formats import FormatError, formats, schema_files
from megatron_npu.formats.compare_results import CompareResults
from megatron_npu.formats.fairness_record import FairnessRecord
from megatron_npu.formats.lambada_result import LambadaResult
from megatron_npu.formats.metrics import MetricsFile
from megatron_npu.formats.parity_record import ParityRecord
from megatron_npu.formats.run_record import RunRecord

DOCS = Path(__file__).resolve().parents[1] / "docs" / "schemas"


def test_docs_hold_the_schemas_the_models_generate():
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in DOCS.glob("*.schema.json")}
    generated = schema_files()
    stale = sorted(n for n in generated if on_disk.get(n) != generated[n])
    extra = sorted(set(on_disk) - set(generated))
    assert not stale and not extra, (
        f"docs/schemas is stale ({stale}) or holds schemas of no format ({extra}): "
        "run python -m megatron_npu.formats docs/schemas"
    )


def test_every_format_says_what_it_holds():
    for name, model in formats().items():
        assert model.__doc__ and model.json_schema()["description"], name


def _metrics(**summary) -> dict:
    return {
        "config": {"arguments": {"hidden_size": 64}, "world_size": 1},
        "steps": [
            {"step": 1, "lm_loss": 7.0, "skipped": False},
            {"step": 2, "lm_loss": 6.9, "skipped": False},
        ],
        "summary": summary,
    }


def test_a_bad_field_is_named_with_its_file(tmp_path):
    data = _metrics()
    data["steps"][1]["lm_loss"] = "low"
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError) as bad:
        MetricsFile.read(path)
    assert str(bad.value).startswith(f"{path}: steps[1].lm_loss: ")
    assert "'low'" in str(bad.value)
    path.write_text('{"config": ')
    with pytest.raises(FormatError, match=rf"^{path}: is not JSON \(.*line 1"):
        MetricsFile.read(path)
    with pytest.raises(FormatError, match=rf"^{tmp_path / 'none.json'}: cannot be read"):
        MetricsFile.read(tmp_path / "none.json")


def test_a_file_read_and_written_again_is_the_same_file(tmp_path):
    data = _metrics(steps=2, peak={"tflops": 1.5, "source": "user"}, newer_field=[1, 2])
    data["steps"][0]["moe_aux_losses"] = {"load_balancing_loss": 0.25}
    path = tmp_path / "metrics.json"
    MetricsFile.parse(data).write(path)
    assert json.loads(path.read_text()) == data
    assert oct(path.stat().st_mode & 0o777) == "0o640"


def test_non_finite_numbers_are_strict_json(tmp_path):
    data = _metrics(first_lm_loss=float("nan"))
    data["steps"][0]["lm_loss"] = float("inf")
    text = MetricsFile.parse(data).to_json()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert back["steps"][0]["lm_loss"] is None and back["summary"]["first_lm_loss"] is None


COMPETITOR = Path(__file__).resolve().parents[1] / "competitor"


@pytest.mark.parametrize("machine", ["nvidia-h100", "nvidia-h200", "nvidia-h200-gpu-check"])
def test_committed_compare_results_read_and_write_back_unchanged(machine, tmp_path):
    path = COMPETITOR / machine / "results.json"
    results = CompareResults.read(path)
    assert json.loads(results.to_json()) == json.loads(path.read_text())
    results.write(tmp_path / "results.json")
    assert CompareResults.read(tmp_path / "results.json") == results


def test_the_committed_fairness_record_reads_back_and_its_ratio_is_checked(tmp_path):
    path = COMPETITOR / "nvidia-h200-gpu-check" / "fairness.json"
    record = FairnessRecord.read(path)
    assert json.loads(record.to_json()) == json.loads(path.read_text())
    assert (record.device, record.shape.num_layers, record.fair) == ("cuda", 24, False)
    data = json.loads(path.read_text())
    data["ratio"] = 1.2  # not the figures' own ratio
    (tmp_path / "fairness.json").write_text(json.dumps(data))
    with pytest.raises(FormatError, match=r"fairness\.json: ratio: 1\.2 is not "):
        FairnessRecord.read(tmp_path / "fairness.json")


def test_compare_results_keep_non_finite_numbers_as_strings():
    data = json.loads((COMPETITOR / "nvidia-h100" / "results.json").read_text())
    data["runs"][0]["perf"]["mfu"] = "NaN"
    data["verdicts"][1]["per_step"]["rel_diff"][0] = "Infinity"
    results = CompareResults.parse(data)
    assert math.isnan(results.runs[0].perf.mfu)
    assert json.loads(results.to_json()) == data


def test_a_bad_compare_results_field_is_one_error_naming_file_and_field(tmp_path):
    data = json.loads((COMPETITOR / "nvidia-h100" / "results.json").read_text())
    path = tmp_path / "results.json"
    data["runs"][1]["steps"][2]["iteration"] = "third"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError, match=rf"^{path}: runs\[1\]\.steps\[2\]\.iteration: .*'third'"):
        CompareResults.read(path)
    data["schema_version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError) as bad:
        CompareResults.read(path)
    assert str(bad.value) == f"{path}: schema_version: 2 is not supported (this version of " + (
        "megatron-npu reads 1)"
    )
    data["schema"] = "megatron-npu/parity"
    with pytest.raises(FormatError, match=r"^<data>: schema: not a compare results file"):
        CompareResults.parse(data)


def test_run_records_old_and_new_are_read_and_a_bad_one_is_named(tmp_path):
    from megatron_npu.compare.runner import read_record

    path = tmp_path / "run.json"
    old = {  # a record of an older version: no session, no lambada
        "config_hash": "0123456789abcdef",
        "status": "ok",
        "error": None,
        "wall_s": 12,
        "command": ["python", "-m", "megatron_npu.cli", "train"],
    }
    path.write_text(json.dumps(old, indent=2) + "\n")
    record = RunRecord.read(path)
    assert record.session is None and record.lambada is None and record.wall_s == 12
    lambada = {"task": "lambada", "accuracy": 0.5, "correct": 1, "n": 2, "strict": False}
    record.lambada = LambadaResult.parse(lambada)
    record.write(path)
    assert json.loads(path.read_text()) == {**old, "lambada": lambada}
    path.write_text(json.dumps({**old, "status": ["ok"]}))
    with pytest.raises(FormatError, match=rf"^{path}: status: .*\['ok'\]"):
        RunRecord.read(path)
    assert read_record(path) is None  # the run is not reused: it runs again


def test_a_document_may_write_non_finite_numbers_as_strings():
    """locate's files write a non-finite number as "NaN" / "Infinity" (null has a meaning of its
    own there), read it back as the float, and their schema allows the strings."""
    from megatron_npu.formats.locate_dump import DumpIndex

    entry = {
        "key": "optimizer#0|param.update:w|0",
        "module": "optimizer",
        "call": 0,
        "quantity": "param.update:w",
        "index": 0,
        "order": 0,
        "shape": [2],
        "dtype": "float32",
        "sampled": False,
        "stats": {"numel": 2, "l2": float("nan")},
        "param_owner": "model",
        "data_name": "optimizer.update.w.pt",
    }
    data = {"rank": 0, "coords": {"tp": 0, "pp": 0, "dp": 0}, "limit": 8, "entries": [entry]}
    text = DumpIndex.parse({**data, "modules": {}}).to_json()
    assert '"l2": "NaN"' in text
    assert math.isnan(DumpIndex.parse(json.loads(text)).entries[0].stats.l2)
    l2 = DumpIndex.json_schema()["$defs"]["TensorStats"]["properties"]["l2"]
    assert {"enum": ["NaN", "Infinity", "-Infinity"]} in l2["anyOf"]


# --------------------------------------------------------------------------- parity record


@pytest.fixture(scope="module")
def parity_record_file(tmp_path_factory) -> Path:
    """A real record: one bf16 cell of the parity harness, written by its writer."""
    from megatron_npu.parity.case import Parallel
    from megatron_npu.parity.harness import Job, evaluate
    from megatron_npu.parity.matrix import case_examples
    from megatron_npu.parity.results import write_record

    import megatron_npu

    examples = case_examples("bias-swiglu", "quick")[:1]
    job = Job("activation.bias-swiglu", "npu-emulated", "bfloat16", Parallel(), examples)
    try:
        return write_record(evaluate(job, seed=3), tmp_path_factory.mktemp("parity"))
    finally:
        megatron_npu.restore()


def _documented_record() -> str:
    doc = (DOCS.parent / "parity-results.md").read_text(encoding="utf-8")
    return doc.split("## Example record", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]


def test_real_parity_records_round_trip(parity_record_file, tmp_path):
    written = parity_record_file.read_text(encoding="utf-8")
    record = ParityRecord.read(parity_record_file)
    assert record.benchmark is not None and record.tensors  # a 16-bit cell: every section
    assert record.to_json() == written
    documented = tmp_path / "documented.json"
    documented.write_text(_documented_record())
    assert ParityRecord.read(documented).to_json() == documented.read_text()


@pytest.mark.parametrize(
    ("plant", "error"),
    [
        (
            lambda d: d["tensors"]["out"]["verdict"].update(status="fine"),
            "tensors.out.verdict.status: input should be 'pass', 'warning' or 'error' (got 'fine')",
        ),
        (
            lambda d: d["parallel"].update(world="1"),
            "parallel.world: input should be a valid integer (got '1')",
        ),
        (
            lambda d: d["tensors"]["out"].pop("metrics"),
            "tensors.out.metrics: field required",
        ),
        (
            lambda d: d.update(tensors={}),
            "tensors: a parity record needs at least one compared tensor, unless it is an error "
            "with rule crash / timeout / reference_hygiene",
        ),
    ],
)
def test_a_bad_parity_record_field_is_one_error_for_both_readers(
    parity_record_file, tmp_path, plant, error
):
    from megatron_npu.parity.results import read_records
    from megatron_npu.reports.errors import Skipped
    from megatron_npu.reports.parity_records import read_folder

    data = json.loads(parity_record_file.read_text(encoding="utf-8"))
    plant(data)
    bad = tmp_path / parity_record_file.name
    bad.write_text(json.dumps(data))
    with pytest.raises(FormatError) as harness:  # the harness's reader stops at the file
        read_records(tmp_path)
    assert str(harness.value) == f"{bad}: {error}"
    assert read_folder(tmp_path) == ([], [Skipped(str(bad), error)])  # the report skips it


def test_what_a_writer_fills_in_after_building_a_document_is_written(tmp_path):
    """A field left at its default and then changed in place (a list appended to, a default part
    filled in) is written, while a field a file never had stays out of it."""
    from megatron_npu.formats.locate_curve import LocateCurve

    curve = LocateCurve.empty()
    curve.add(1, 2.0, None)
    assert json.loads(curve.to_json()) == {"iterations": [1], "losses": [2.0], "grad_norms": [None]}
    metrics = MetricsFile.parse(_metrics())
    assert "summary" in json.loads(metrics.to_json())  # given, though empty
    bare = MetricsFile.parse({"config": {"arguments": {}}, "steps": []})
    assert "summary" not in json.loads(bare.to_json())  # never given: left out
    bare.summary.steps = 0
    assert json.loads(bare.to_json())["summary"] == {"steps": 0}  # filled in: written
