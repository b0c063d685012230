"""``results.json`` (schema ``megatron-npu/compare`` v1, docs/compare-results.md) and its parts."""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

from megatron_npu.versions import library_versions

SCHEMA = "megatron-npu/compare"
SCHEMA_VERSION = 1


def provenance(argv: list[str] | None) -> dict[str, Any]:
    from megatron_npu.parity.provenance import git_info

    versions = library_versions()
    git = git_info()
    return {
        "megatron_npu": versions.get("megatron-npu"),
        "megatron_core": versions.get("megatron-core"),
        "torch": versions.get("torch"),
        "torch_npu": versions.get("torch_npu"),
        "python": versions.get("python"),
        "commit": git.commit if git else None,
        "dirty": git.dirty if git else None,
        "host": platform.node(),
        "command": list(argv if argv is not None else sys.argv),
    }


def document(
    *,
    matrix: str,
    baseline: str,
    runs: list[dict],
    verdicts: list[dict],
    table2: list[dict],
    skipped: list[dict],
    notes: list[str],
    argv: list[str] | None,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "matrix": matrix,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "provenance": provenance(argv),
        "baseline": baseline,
        "runs": runs,
        "verdicts": verdicts,
        "table2": table2,
        "skipped": skipped,
        "notes": notes,
    }


def strict_json(value: Any) -> Any:
    """Non-finite floats as the strings "NaN", "Infinity", "-Infinity" (as the parity records)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write(out_dir: Path, results: dict[str, Any], table_markdown: str) -> tuple[Path, Path]:
    from megatron_npu.files import write_private

    results_path, table_path = out_dir / "results.json", out_dir / "table2.md"
    write_private(results_path, json.dumps(strict_json(results), indent=2, allow_nan=False) + "\n")
    write_private(table_path, table_markdown)
    return results_path, table_path
