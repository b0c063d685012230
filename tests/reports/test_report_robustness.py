"""Any damage to a well-formed input gives a skipped entry or a rendered row, never an
exception: random leaves of a real parity record and of a compare results file are replaced by
random JSON values, and the page must still render."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron_npu.reports.build import render
from megatron_npu.reports.inputs import load

JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _leaves(data: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _leaves(v, (*path, k))] or [path]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _leaves(v, (*path, i))] or [path]
    return [path]


def _replace(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    data[path[0]] = _replace(data[path[0]], path[1:], value)
    return data


def _damaged(original: Path, target: Path, choice: int, value: Any) -> None:
    data = json.loads(original.read_text())
    leaves = _leaves(data)
    target.write_text(json.dumps(_replace(data, leaves[choice % len(leaves)], value)))


SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@SETTINGS
@given(choice=st.integers(0, 10_000), value=JSON_VALUES)
def test_damaged_parity_record_renders(parity_runs, tmp_path, choice, value):
    record = sorted(parity_runs["base"].glob("*.json"))[0]
    folder = tmp_path / f"run-{choice}"
    folder.mkdir(exist_ok=True)
    _damaged(record, folder / record.name, choice, value)
    rs = load([folder])
    assert len(rs.parity) + len(rs.skipped) == 1
    assert "<html" in render(rs, base=load([parity_runs["base"]]))


@SETTINGS
@given(choice=st.integers(0, 10_000), value=JSON_VALUES)
def test_damaged_compare_results_render(compare_dir, tmp_path, choice, value):
    folder = tmp_path / f"cmp-{choice}"
    folder.mkdir(exist_ok=True)
    _damaged(compare_dir / "results.json", folder / "results.json", choice, value)
    rs = load([folder])
    assert len(rs.comparisons) + len(rs.skipped) == 1
    assert "<html" in render(rs, base=load([compare_dir]))
