"""``locate.json``: what ``megatron-npu locate`` found (schema: docs/locate.md).

Top-level fields (schema version :data:`SCHEMA_VERSION`)::

    format, schema_version, reference {label, device, argv, plant?}, candidate {...},
    step {step, quantity, rel_error, threshold, approximate{status, detail, tolerance}},
    replayed_step, rule {base, growth, gain}, modules [row...], divergent (null | {module, name,
    shard, rank, kind, phase, output, input, ratio, tolerance, diverges, worst}),
    culprit (null | {culprits, candidate_sets, trials, note}), reproduce, timing {phase: s}

A row of ``modules``: ``name`` (with ``@shard`` under TP/PP), ``module``, ``rank``, ``shard``,
``kind``, ``depth``, ``patches {own, total}`` and per phase (``forward``, ``backward``,
``update``) ``{output, input, ratio, tolerance, diverges, worst}``; errors are ``rel_l2`` of
:func:`megatron_npu.parity.metrics.compare`, non-finite ones written ``"Infinity"``/``"NaN"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_npu.files import write_private

FORMAT = "megatron-npu-locate"
SCHEMA_VERSION = 1
FILENAME = "locate.json"


class LocateResultError(ValueError):
    """A file is not a readable ``locate.json``."""


REQUIRED = ("reference", "candidate", "step", "modules", "divergent", "culprit", "reproduce")


def write(out_dir: str | Path, data: dict[str, Any]) -> Path:
    body = {"format": FORMAT, "schema_version": SCHEMA_VERSION, **data}
    return write_private(Path(out_dir) / FILENAME, json.dumps(body, indent=2) + "\n")


def is_locate(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == FORMAT


def validate(data: Any, source: str = "locate.json") -> dict[str, Any]:
    """``data`` if it is a locate result of this schema; :class:`LocateResultError` otherwise."""
    if not is_locate(data):
        raise LocateResultError(f"{source}: not a {FORMAT} result")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise LocateResultError(
            f"{source}: schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise LocateResultError(f"{source}: missing field(s) {', '.join(missing)}")
    if not isinstance(data["modules"], list):
        raise LocateResultError(f"{source}: 'modules' must be a list")
    return data


def read(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise LocateResultError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise LocateResultError(f"{path}: not valid JSON ({exc})") from None
    return validate(data, str(path))
