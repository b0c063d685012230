"""``megatron-npu compare`` results (``docs/compare-results.md``: ``<out>/results.json``).

One results file is one comparison: several training runs of the same model, a baseline run,
rule verdicts (candidate vs baseline, with per-step relative differences) and the Table 2 rows.
Reading validates what the report draws and names the first bad key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPARE_SCHEMA = "megatron-npu/compare"
COMPARE_VERSIONS = (1,)
RESULTS_FILE = "results.json"


class BadCompareResults(ValueError):
    """A results.json that cannot be shown; names the key."""


@dataclass(frozen=True)
class Run:
    name: str
    device: str | None  # None: none of the run's devices was available
    emulated: bool
    status: str
    error: str | None
    command: list[str]
    options: dict[str, Any]
    iterations: list[int]
    losses: list[float | None]
    grad_norms: list[float | None]
    perf: dict[str, Any] | None
    lambada: dict[str, Any] | None
    wall_s: float | None


@dataclass(frozen=True)
class Comparison:
    source: str
    title: str
    matrix: str | None
    created: str | None
    baseline: str | None
    provenance: dict[str, Any]
    runs: list[Run]
    verdicts: list[dict[str, Any]]
    table2: list[dict[str, Any]]
    skipped_runs: list[dict[str, Any]]  # optional runs not run here, with the reason
    notes: list[str]

    def run(self, name: str) -> Run | None:
        return next((r for r in self.runs if r.name == name), None)


def _need(data: Any, key: str, types: type | tuple[type, ...], where: str) -> Any:
    path = f"{where}.{key}" if where else key
    if not isinstance(data, dict) or key not in data:
        raise BadCompareResults(f"missing key {path!r}")
    value = data[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        raise BadCompareResults(f"bad key {path!r}: {value!r}")
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _run(data: Any, index: int) -> Run:
    where = f"runs[{index}]"
    steps = _need(data, "steps", list, where)
    iterations: list[int] = []
    losses: list[float | None] = []
    grad_norms: list[float | None] = []
    for j, step in enumerate(steps):
        iterations.append(_need(step, "iteration", int, f"{where}.steps[{j}]"))
        losses.append(_number(step.get("loss")) if isinstance(step, dict) else None)
        grad_norms.append(_number(step.get("grad_norm")) if isinstance(step, dict) else None)
    return Run(
        name=_need(data, "name", str, where),
        device=_need(data, "device", (str, type(None)), where),
        emulated=_need(data, "emulated", bool, where),
        status=_need(data, "status", str, where),
        error=data.get("error"),
        command=[str(a) for a in data.get("command") or []],
        options=data.get("options") or {},
        iterations=iterations,
        losses=losses,
        grad_norms=grad_norms,
        perf=data.get("perf"),
        lambada=data.get("lambada"),
        wall_s=_number(data.get("wall_s")),
    )


def parse(data: Any, source: str) -> Comparison:
    if _need(data, "schema", str, "") != COMPARE_SCHEMA:
        raise BadCompareResults(f"key 'schema' is {data['schema']!r}, not {COMPARE_SCHEMA!r}")
    version = _need(data, "schema_version", int, "")
    if version not in COMPARE_VERSIONS:
        raise BadCompareResults(
            f"schema_version {version} is not supported (this report reads {COMPARE_VERSIONS})"
        )
    runs = [_run(r, i) for i, r in enumerate(_need(data, "runs", list, ""))]
    verdicts = _need(data, "verdicts", list, "")
    for i, v in enumerate(verdicts):
        for key in ("candidate", "baseline", "rule", "status"):
            _need(v, key, str, f"verdicts[{i}]")
    table2 = data.get("table2") or []
    if not isinstance(table2, list) or not all(isinstance(row, dict) for row in table2):
        raise BadCompareResults("bad key 'table2': not a list of objects")
    return Comparison(
        source=source,
        title=Path(source).parent.name or source,
        matrix=data.get("matrix"),
        created=data.get("created"),
        baseline=data.get("baseline"),
        provenance=data.get("provenance") or {},
        runs=runs,
        verdicts=verdicts,
        table2=table2,
        skipped_runs=[r for r in data.get("skipped") or [] if isinstance(r, dict)],
        notes=[str(n) for n in data.get("notes") or []],
    )


def looks_like_compare(data: Any) -> bool:
    return isinstance(data, dict) and data.get("schema") == COMPARE_SCHEMA


def read(path: Path) -> Comparison:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise BadCompareResults(f"unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadCompareResults(f"not valid JSON (truncated or corrupt): {exc}") from None
    return parse(data, str(path))
