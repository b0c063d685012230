"""Structured parity results: one JSON record per (patch, case, dtype, parallel sizes, device).

The schema is documented in ``docs/parity-results.md``; bump :data:`SCHEMA_VERSION` whenever a
key is added, removed or changes meaning. Records are written atomically (temp file in the same
directory, fsync, ``os.replace``), so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_npu.parity.benchmark import BENCHMARK_PATH, BenchmarkResult
from megatron_npu.parity.metrics import TensorComparison, dtype_config
from megatron_npu.parity.provenance import GitInfo, Provenance, check_device
from megatron_npu.parity.verdict import Tolerance, Verdict, final_verdict, worst

from megatron_npu.devices.facts import DEVICE_ORDER, NPU, NPU_EMULATED
from megatron_npu.files import write_private

__all__ = [
    "DEVICES",
    "PARALLEL_KEYS",
    "SCHEMA_VERSION",
    "ParityRecord",
    "RecordError",
    "TensorResult",
    "read_records",
    "record_filename",
    "write_record",
]

SCHEMA_VERSION = 3
#: versions read_records accepts (a schema-1 record has no kernels / benchmark keys)
READABLE_VERSIONS = (1, 2, 3)
#: verdict rules of a record that compared nothing (the cell failed before any comparison)
NO_TENSOR_RULES = ("crash", "timeout", "reference_hygiene")
# "npu" only for a real Ascend NPU through torch_npu; the CPU emulation of torch_npu's kernels
# is "npu-emulated", never "npu".
DEVICES = DEVICE_ORDER
PARALLEL_KEYS = ("tp", "pp", "dp", "cp", "world")
#: the first schema whose ``parallel`` has the context-parallel size; older records had CP 1
_CP_SCHEMA = 3


class RecordError(ValueError):
    """A results file that cannot be read as a :class:`ParityRecord`; names file and key."""


# --------------------------------------------------------------------------- record


@dataclass(frozen=True)
class TensorResult:
    comparison: TensorComparison
    verdict: Verdict


@dataclass(frozen=True)
class BenchmarkSection:
    """msprobe's stage-2 benchmark of a 16-bit cell (see :mod:`megatron_npu.parity.benchmark`)."""

    path: str  # what ran as the benchmark, in words
    level: str  # msprobe level L0 / L1 / L2
    tensors: dict[str, BenchmarkResult]  # per float tensor
    unavailable: str | None = None  # why the benchmark could not run (then tensors is empty)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "level": self.level,
            "unavailable": self.unavailable,
            "tensors": {n: b.to_dict() for n, b in self.tensors.items()},
        }


@dataclass(frozen=True)
class ParityRecord:
    """The result of one parity case; ``to_dict`` gives the JSON object of the schema."""

    patch_id: str
    target: str  # dotted path of the patched function
    case: str
    dtype: str  # float16 / bfloat16 / float32
    parallel: dict[str, int]  # exactly tp, pp, dp, cp, world
    device: str  # one of DEVICES
    tensors: dict[str, TensorResult]
    verdict: Verdict  # overall: the worst tensor verdict
    tolerance: Tolerance | None
    provenance: Provenance
    schema_version: int = SCHEMA_VERSION
    kernels: dict[str, int] | None = None  # emulated NPU kernel -> calls in the tested path
    npu_kernel_exercised: bool | None = None  # None only in a schema-1 record (unknown)
    benchmark: BenchmarkSection | None = None

    def __post_init__(self) -> None:
        for name in ("patch_id", "target", "case"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        dtype_config(self.dtype)
        _check_parallel(self.parallel)
        check_device(self.device)
        if self.provenance.device != self.device:
            raise ValueError(
                f"provenance.device {self.provenance.device!r} != device {self.device!r}"
            )
        if self.device == NPU and self.provenance.torch_npu is None:
            raise ValueError(
                f"device {NPU!r} needs provenance.torch_npu; emulated runs are {NPU_EMULATED!r}"
            )
        if not self.tensors:
            if self.verdict.status != "error" or self.verdict.rule not in NO_TENSOR_RULES:
                raise ValueError(
                    "a parity record needs at least one compared tensor, unless it is an error "
                    f"with rule {' / '.join(NO_TENSOR_RULES)}"
                )
        else:
            worst_status = worst(t.verdict for t in self.tensors.values()).status
            if self.verdict.status != worst_status:
                raise ValueError(
                    f"overall verdict {self.verdict.status!r} is not the worst tensor verdict "
                    f"{worst_status!r}"
                )
        if self.schema_version not in READABLE_VERSIONS:
            raise ValueError(
                f"schema_version {self.schema_version} is not supported (expected one of "
                f"{READABLE_VERSIONS})"
            )
        if self.schema_version >= 2:
            if not isinstance(self.kernels, dict) or not isinstance(
                self.npu_kernel_exercised, bool
            ):
                raise ValueError("a schema-2 record needs kernels (dict) and npu_kernel_exercised")
            if self.npu_kernel_exercised != any(v > 0 for v in self.kernels.values()):
                raise ValueError("npu_kernel_exercised must say whether any kernel was called")

    @classmethod
    def build(
        cls,
        *,
        patch_id: str,
        target: str,
        case: str,
        dtype: str,
        parallel: Mapping[str, int],
        comparisons: Mapping[str, TensorComparison],
        provenance: Provenance,
        tolerance: Tolerance | None = None,
        benchmarks: Mapping[str, BenchmarkResult | None] | None = None,
        benchmark_level: str = "L0",
        benchmark_unavailable: str | None = None,
        kernels: Mapping[str, int] | None = None,
    ) -> ParityRecord:
        """A record whose tensor and overall verdicts are computed from ``comparisons`` and,
        for 16-bit cells, the stage-2 ``benchmarks`` (tensor name -> result or None)."""
        benchmarks = dict(benchmarks or {})
        tensors = {
            name: TensorResult(comp, final_verdict(comp, tolerance, benchmarks.get(name)))
            for name, comp in comparisons.items()
        }
        judged = {n: b for n, b in benchmarks.items() if b is not None}
        section = None
        if judged or benchmark_unavailable:
            section = BenchmarkSection(
                BENCHMARK_PATH, benchmark_level, judged, benchmark_unavailable
            )
        kernels = {k: int(v) for k, v in (kernels or {}).items()}
        return cls(
            kernels=kernels,
            npu_kernel_exercised=any(v > 0 for v in kernels.values()),
            benchmark=section,
            patch_id=patch_id,
            target=target,
            case=case,
            dtype=dtype,
            parallel=dict(parallel),
            device=provenance.device,
            tensors=tensors,
            verdict=_overall(tensors),
            tolerance=tolerance,
            provenance=provenance,
        )

    @classmethod
    def failed(
        cls, *, rule: str, reason: str, provenance: Provenance, **identity: Any
    ) -> ParityRecord:
        """The record of a cell that crashed, timed out or whose reference touched the
        implementation: an error without tensors. ``identity``: ``patch_id``, ``target``,
        ``case``, ``dtype``, ``parallel`` and optionally ``tolerance``, as for :meth:`build`."""
        return cls(
            **{"tolerance": None, **identity, "parallel": dict(identity["parallel"])},
            device=provenance.device,
            tensors={},
            verdict=Verdict("error", f"{rule}: {reason}", rule),
            provenance=provenance,
            kernels={},
            npu_kernel_exercised=False,
        )

    def to_dict(self) -> dict[str, Any]:
        prov = self.provenance
        return {
            "schema_version": self.schema_version,
            "kernels": dict(self.kernels or {}),
            "npu_kernel_exercised": self.npu_kernel_exercised,
            "benchmark": None if self.benchmark is None else self.benchmark.to_dict(),
            "patch_id": self.patch_id,
            "target": self.target,
            "case": self.case,
            "dtype": self.dtype,
            "parallel": {k: self.parallel[k] for k in PARALLEL_KEYS},
            "device": self.device,
            "tensors": {
                name: {"metrics": t.comparison.to_dict(), "verdict": t.verdict.to_dict()}
                for name, t in self.tensors.items()
            },
            "verdict": self.verdict.to_dict(),
            "tolerance": None if self.tolerance is None else self.tolerance.to_dict(),
            "provenance": {
                "device": prov.device,
                "device_name": prov.device_name,
                "python": prov.python,
                "torch": prov.torch,
                "torch_npu": prov.torch_npu,
                "megatron_core": prov.megatron_core,
                "megatron_npu": prov.megatron_npu,
                "git": None
                if prov.git is None
                else {"commit": prov.git.commit, "dirty": prov.git.dirty},
                "seed": prov.seed,
                "hostname": prov.hostname,
                "timestamp_utc": prov.timestamp_utc,
                "wall_time_s": prov.wall_time_s,
            },
        }

    @classmethod
    def from_dict(cls, data: Any) -> ParityRecord:
        """Validate and load; RecordError names the bad key (dotted path)."""
        return _parse_record(data)


def _overall(tensors: Mapping[str, TensorResult]) -> Verdict:
    if not tensors:
        raise ValueError("a parity record needs at least one compared tensor")
    name, result = max(
        tensors.items(),
        key=lambda kv: (kv[1].verdict.severity, -_cosine_or_one(kv[1].comparison)),
    )
    # max() keeps the first maximal item, so ties go to the first tensor in order
    return Verdict(
        result.verdict.status,
        f"{name}: {result.verdict.reason}",
        result.verdict.rule,
        result.verdict.override,
    )


def _cosine_or_one(c: TensorComparison) -> float:
    return 1.0 if c.cosine is None else c.cosine


def _check_parallel(parallel: Any) -> None:
    if not isinstance(parallel, Mapping) or set(parallel) != set(PARALLEL_KEYS):
        raise ValueError(f"parallel must have exactly the keys {PARALLEL_KEYS}, got {parallel!r}")
    for key in PARALLEL_KEYS:
        value = parallel[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"parallel[{key!r}] must be a positive int, got {value!r}")


# --------------------------------------------------------------------------- parsing


_MISSING = object()


def _get(data: Any, key: str, where: str, types: type | tuple[type, ...]) -> Any:
    path = f"{where}.{key}" if where else key
    if not isinstance(data, dict):
        raise RecordError(f"{where or 'record'} must be a JSON object")
    value = data.get(key, _MISSING)
    if value is _MISSING:
        raise RecordError(f"missing key {path!r}")
    bad_bool = isinstance(value, bool) and bool not in (
        types if isinstance(types, tuple) else (types,)
    )
    if not isinstance(value, types) or bad_bool:
        names = "/".join(
            "null" if t is type(None) else t.__name__
            for t in (types if isinstance(types, tuple) else (types,))
        )
        raise RecordError(f"bad key {path!r}: expected {names}, got {value!r}")
    return value


_NONE = type(None)


def _parse_record(data: Any) -> ParityRecord:
    version = _get(data, "schema_version", "", int)
    if version not in READABLE_VERSIONS:
        raise RecordError(
            f"bad key 'schema_version': {version} is not supported (expected one of "
            f"{READABLE_VERSIONS})"
        )
    kernels: dict[str, int] | None = None
    exercised: bool | None = None
    benchmark: BenchmarkSection | None = None
    if version >= 2:
        kernels = _get(data, "kernels", "", dict)
        for name in kernels:
            _get(kernels, name, "kernels", int)
        exercised = _get(data, "npu_kernel_exercised", "", bool)
        benchmark = _parse_benchmark(_get(data, "benchmark", "", (dict, _NONE)))
    patch_id = _get(data, "patch_id", "", str)
    target = _get(data, "target", "", str)
    case = _get(data, "case", "", str)
    dtype = _get(data, "dtype", "", str)
    parallel = _get(data, "parallel", "", dict)
    if version < _CP_SCHEMA and "cp" not in parallel:
        parallel = {**parallel, "cp": 1}
    for key in PARALLEL_KEYS:
        _get(parallel, key, "parallel", int)
    device = _get(data, "device", "", str)
    if device not in DEVICES:
        raise RecordError(f"bad key 'device': {device!r} is not one of {DEVICES}")

    tensors_raw = _get(data, "tensors", "", dict)
    tensors: dict[str, TensorResult] = {}
    for name, entry in tensors_raw.items():
        where = f"tensors.{name}"
        metrics = _get(entry, "metrics", where, dict)
        try:
            comparison = TensorComparison.from_dict(metrics)
        except KeyError as exc:
            raise RecordError(f"missing key '{where}.metrics.{exc.args[0]}'") from None
        except (TypeError, ValueError) as exc:
            raise RecordError(f"bad key in '{where}.metrics': {exc}") from None
        tensors[name] = TensorResult(comparison, _parse_verdict(entry, where))
    overall = _parse_verdict(data, "")

    tol_raw = _get(data, "tolerance", "", (dict, _NONE))
    tolerance = None
    if tol_raw is not None:
        try:
            tolerance = Tolerance.from_dict(tol_raw)
        except KeyError as exc:
            raise RecordError(f"missing key 'tolerance.{exc.args[0]}'") from None
        except (TypeError, ValueError) as exc:
            raise RecordError(f"bad key in 'tolerance': {exc}") from None

    prov = _get(data, "provenance", "", dict)
    git_raw = _get(prov, "git", "provenance", (dict, _NONE))
    git = None
    if git_raw is not None:
        git = GitInfo(
            commit=_get(git_raw, "commit", "provenance.git", (str, _NONE)),
            dirty=_get(git_raw, "dirty", "provenance.git", bool),
        )
    provenance = Provenance(
        device=_get(prov, "device", "provenance", str),
        device_name=_get(prov, "device_name", "provenance", (str, _NONE)),
        python=_get(prov, "python", "provenance", str),
        torch=_get(prov, "torch", "provenance", str),
        torch_npu=_get(prov, "torch_npu", "provenance", (str, _NONE)),
        megatron_core=_get(prov, "megatron_core", "provenance", (str, _NONE)),
        megatron_npu=(
            _get(prov, "megatron_npu", "provenance", (str, _NONE))
            if "megatron_npu" in prov
            else None
        ),
        git=git,
        seed=_get(prov, "seed", "provenance", (int, _NONE)),
        hostname=_get(prov, "hostname", "provenance", str),
        timestamp_utc=_get(prov, "timestamp_utc", "provenance", str),
        wall_time_s=float(_get(prov, "wall_time_s", "provenance", (int, float))),
    )
    try:
        return ParityRecord(
            patch_id=patch_id,
            target=target,
            case=case,
            dtype=dtype,
            parallel=dict(parallel),
            device=device,
            tensors=tensors,
            verdict=overall,
            tolerance=tolerance,
            provenance=provenance,
            schema_version=version,
            kernels=kernels,
            npu_kernel_exercised=exercised,
            benchmark=benchmark,
        )
    except ValueError as exc:
        raise RecordError(f"invalid record: {exc}") from None


def _parse_benchmark(raw: dict[str, Any] | None) -> BenchmarkSection | None:
    if raw is None:
        return None
    tensors = {}
    for name, entry in _get(raw, "tensors", "benchmark", dict).items():
        try:
            tensors[name] = BenchmarkResult.from_dict(entry)
        except KeyError as exc:
            raise RecordError(f"missing key 'benchmark.tensors.{name}.{exc.args[0]}'") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"bad key in 'benchmark.tensors.{name}': {exc}") from None
    return BenchmarkSection(
        path=_get(raw, "path", "benchmark", str),
        level=_get(raw, "level", "benchmark", str),
        tensors=tensors,
        unavailable=_get(raw, "unavailable", "benchmark", (str, _NONE)),
    )


def _parse_verdict(data: Any, where: str) -> Verdict:
    raw = _get(data, "verdict", where, dict)
    path = f"{where}.verdict" if where else "verdict"
    try:
        return Verdict.from_dict(raw)
    except KeyError as exc:
        raise RecordError(f"missing key '{path}.{exc.args[0]}'") from None
    except ValueError as exc:
        raise RecordError(f"bad key in '{path}': {exc}") from None


# --------------------------------------------------------------------------- files


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part).strip("._") or "_"


def record_filename(
    patch_id: str, case: str, dtype: str, parallel: Mapping[str, int], device: str
) -> str:
    """Deterministic, filesystem-safe file name for one record.

    Readable parts (unsafe characters -> ``_``) plus 10 hex digits of a sha256 over the raw
    key, so two keys that sanitize alike still get different files.
    """
    par = "-".join(f"{k}{parallel[k]}" for k in PARALLEL_KEYS)
    raw = "\x00".join([patch_id, case, dtype, par, device])
    digest = hashlib.sha256(raw.encode("utf-8")).hexdigest()[:10]
    stem = "__".join(_safe(p) for p in (patch_id, case, dtype, par, device))
    return f"{stem[:180]}__{digest}.json"


def write_record(record: ParityRecord, results_dir: str | os.PathLike[str]) -> Path:
    """Write ``record`` atomically into ``results_dir`` (:func:`megatron_npu.files.write_private`:
    a 0640 file, missing directories 0750); return the file's path. A failure at any point leaves
    any previous file intact and no temp file."""
    final = Path(results_dir) / record_filename(
        record.patch_id, record.case, record.dtype, record.parallel, record.device
    )
    text = json.dumps(record.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_private(final, text)


def read_records(results_dir: str | os.PathLike[str]) -> list[ParityRecord]:
    """Load every ``*.json`` record in ``results_dir`` (sorted by name; hidden temp files skipped).

    Raises FileNotFoundError if the directory is missing, RecordError naming the file and the
    missing or bad key otherwise.
    """
    directory = Path(results_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"parity results directory {str(directory)!r} does not exist")
    records = []
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"{path}: not a readable JSON file: {exc}") from None
        try:
            records.append(_parse_record(data))
        except RecordError as exc:
            raise RecordError(f"{path}: {exc}") from None
    return records
