"""pytest-benchmark JSON files (``--benchmark-json``) read for a report.

Each benchmark's ``extra_info`` carries the keys documented in ``perf/README.md`` (``patch_id``,
``op``, ``path``, ``device``, ``emulated``, ``dtype``, ``shape``, ``direction``,
``peak_memory_bytes``); any of them may be missing in older files, and the report then shows what it
has (the group stands in for the op, ``unknown`` for a missing device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megatron_npu.reports import devices

#: The stock Megatron path: what the other paths of the same op are measured against.
BASELINE_PATH = "megatron"


class BadBenchmarkFile(ValueError):
    """A benchmark JSON that cannot be shown; names the key."""


@dataclass(frozen=True)
class Bench:
    name: str
    fullname: str
    op: str
    path: str
    device: str
    emulated: bool
    dtype: str
    shape: str
    direction: str
    patch_id: str | None
    median: float
    q1: float
    q3: float
    mean: float
    stddev: float
    rounds: int
    peak_memory_bytes: int | None
    source: str

    @property
    def line(self) -> tuple[str, str, str, str, str]:
        """Benchmarks on one line of the comparison table: same op, dtype, shape, direction and
        device; they differ only in path."""
        return (self.op, self.dtype, self.shape, self.direction, self.device)


@dataclass(frozen=True)
class BenchmarkFile:
    source: str
    datetime: str | None
    version: str | None
    machine_info: dict[str, Any]
    commit_info: dict[str, Any]
    benches: list[Bench]


def looks_like_benchmark(data: Any) -> bool:
    return isinstance(data, dict) and "benchmarks" in data and "machine_info" in data


def _text(value: Any, default: str) -> str:
    if value is None or value == "":
        return default
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _bench(data: Any, index: int, source: str) -> Bench:
    where = f"benchmarks[{index}]"
    if not isinstance(data, dict):
        raise BadBenchmarkFile(f"{where} is not an object")
    stats = data.get("stats")
    if not isinstance(stats, dict):
        raise BadBenchmarkFile(f"missing key '{where}.stats'")
    numbers = {}
    for key in ("median", "q1", "q3", "mean", "stddev", "rounds"):
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadBenchmarkFile(f"bad key '{where}.stats.{key}': {value!r}")
        numbers[key] = value
    extra = data.get("extra_info") or {}
    device = _text(extra.get("device"), "unknown")
    emulated = extra.get("emulated")
    peak = extra.get("peak_memory_bytes")
    return Bench(
        name=str(data.get("name", where)),
        fullname=str(data.get("fullname") or data.get("name") or where),
        op=_text(extra.get("op") or data.get("group"), str(data.get("name", where))),
        path=_text(extra.get("path"), "unknown"),
        device=device,
        emulated=bool(emulated) if isinstance(emulated, bool) else devices.is_emulated(device),
        dtype=_text(extra.get("dtype"), "-"),
        shape=_text(extra.get("shape"), "-"),
        direction=_text(extra.get("direction"), "-"),
        patch_id=extra.get("patch_id"),
        median=float(numbers["median"]),
        q1=float(numbers["q1"]),
        q3=float(numbers["q3"]),
        mean=float(numbers["mean"]),
        stddev=float(numbers["stddev"]),
        rounds=int(numbers["rounds"]),
        peak_memory_bytes=peak if isinstance(peak, int) and not isinstance(peak, bool) else None,
        source=source,
    )


def parse(data: Any, source: str) -> BenchmarkFile:
    benches = data.get("benchmarks")
    if not isinstance(benches, list):
        raise BadBenchmarkFile("bad key 'benchmarks': not a list")
    return BenchmarkFile(
        source=source,
        datetime=data.get("datetime"),
        version=data.get("version"),
        machine_info=data.get("machine_info") or {},
        commit_info=data.get("commit_info") or {},
        benches=[_bench(b, i, source) for i, b in enumerate(benches)],
    )
