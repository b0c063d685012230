"""``results.json`` (:mod:`megatron_npu.formats.compare_results`) and its provenance."""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path
from typing import Any

from megatron_npu.formats.compare_results import SCHEMA, SCHEMA_VERSION, CompareResults
from megatron_npu.versions import library_versions


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
) -> CompareResults:
    """The results document; the parts are validated against their models here."""
    return CompareResults(
        schema=SCHEMA,
        schema_version=SCHEMA_VERSION,
        matrix=matrix,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        provenance=provenance(argv),
        baseline=baseline,
        runs=runs,
        verdicts=verdicts,
        table2=table2,
        skipped=skipped,
        notes=notes,
    )


def write(out_dir: Path, results: CompareResults, table_markdown: str) -> tuple[Path, Path]:
    from megatron_npu.files import write_private

    results_path, table_path = out_dir / "results.json", out_dir / "table2.md"
    results.write(results_path)
    write_private(table_path, table_markdown)
    return results_path, table_path
