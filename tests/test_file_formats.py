"""The file formats (``megatron_npu.formats``): the JSON Schemas in ``docs/schemas/`` are the
ones the models generate, and a file that does not fit is one error naming the file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_npu.formats import FormatError, formats, schema_files
from megatron_npu.formats.metrics import MetricsFile

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
