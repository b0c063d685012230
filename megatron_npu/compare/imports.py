"""Runs imported from another machine (a matrix ``[[run]]`` with ``import = "PATH"``).

The kind is told by content, never by the name:

* a folder, or a file named ``*tfevents*``: a TensorBoard event folder written by Megatron-LM
  (:mod:`.tensorboard_events`);
* a JSON object with ``config``, ``steps`` and ``summary``: a ``megatron-npu train
  --metrics-out`` file;
* a JSON object with ``"schema": "megatron-npu/compare"``: a ``compare`` ``results.json``; the
  run is the one the matrix names in ``run = "NAME"`` (or the only one), read from the
  ``metrics.json`` beside it (``runs/NAME/metrics.json``);
* any other text with Megatron-LM's argument dump or iteration lines: a Megatron-LM log
  (:mod:`.mlm_log`).

Each becomes a metrics document in ``megatron-npu train``'s ``--metrics-out`` shape, so every
rule reads an imported run like a local one. Its device is the file's own (``config.device``
of a metrics file) or the matrix's ``device``; a log or event folder says nothing of it, so the
matrix must. Every problem is an :class:`ImportedRunError` naming the file (and line).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_npu.compare import mlm_log, tensorboard_events
from megatron_npu.compare.textfile import read_text
from megatron_npu.formats import FormatError
from megatron_npu.formats.compare_results import SCHEMA as COMPARE_SCHEMA
from megatron_npu.formats.compare_results import CompareResults
from megatron_npu.formats.metrics import MetricsFile

METRICS_KEYS = ("config", "steps", "summary")


class ImportedRunError(ValueError):
    """An import that cannot be used; the message names the file (and line)."""


@dataclass
class Imported:
    metrics: MetricsFile
    device: str | None  # what the file says, if anything
    emulated: bool
    provenance: dict[str, Any]  # kind, path, sha256, and what the file says of its origin


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _check_metrics(data: Any, path: Path) -> MetricsFile:
    """The metrics file's model (:class:`~megatron_npu.formats.metrics.MetricsFile`), with what
    compare needs of an imported run beyond it: at least one step, each with its time."""
    if not isinstance(data, dict) or not all(k in data for k in METRICS_KEYS):
        raise ImportedRunError(
            f"{path}: not a megatron-npu metrics.json (needs {list(METRICS_KEYS)})"
        )
    try:
        metrics = MetricsFile.parse(data, str(path))
    except FormatError as exc:
        raise ImportedRunError(str(exc)) from None
    if not metrics.steps:
        raise ImportedRunError(f"{path}: 'steps' is empty: the run logged no step")
    for i, step in enumerate(metrics.steps):
        if step.step_time_s is None:
            raise ImportedRunError(f"{path}: steps[{i}].step_time_s: a number is needed")
    return metrics


def _read_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ImportedRunError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}): "
            "truncated or corrupt"
        ) from None


def _from_results(data: dict, path: Path, run: str | None) -> tuple[MetricsFile, dict[str, Any]]:
    try:
        results = CompareResults.parse(data, str(path))
    except FormatError as exc:
        raise ImportedRunError(str(exc)) from None
    if not results.runs:
        raise ImportedRunError(f"{path}: a compare results.json without runs")
    names = [r.name for r in results.runs]
    if run is None:
        if len(names) != 1:
            raise ImportedRunError(f'{path}: holds runs {names}: name one with run = "NAME"')
        run = names[0]
    entry = results.run(run)
    if entry is None:
        raise ImportedRunError(f"{path}: no run {run!r} in it (runs: {names})")
    metrics_path = path.parent / (entry.metrics_path or f"runs/{run}/metrics.json")
    try:
        text = metrics_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ImportedRunError(
            f"{path}: run {run!r}: cannot read its metrics {metrics_path}: {exc.strerror or exc} "
            "(copy the whole compare folder)"
        ) from None
    metrics = _check_metrics(_read_json(metrics_path, text), metrics_path)
    origin = {
        "results": str(path),
        "run": run,
        "created": results.created,
        "provenance": results.provenance.model_dump(exclude_unset=True)
        if results.provenance
        else None,
    }
    return metrics, origin


def load(path: str | Path, run: str | None = None) -> Imported:
    """Read one imported run (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise ImportedRunError(f"{path}: no such file or folder")
    if path.is_dir() or "tfevents" in path.name:
        try:
            events = tensorboard_events.read(path)
        except tensorboard_events.EventFolderError as exc:
            raise ImportedRunError(str(exc)) from None
        metrics = tensorboard_events.to_metrics(events, str(path))
        return Imported(metrics, None, False, {"kind": "tensorboard", "path": str(path)})
    text = read_text(
        path,
        ImportedRunError,
        "text file",
        "a log, metrics.json or results.json was expected (an event file's name contains "
        "'tfevents')",
    )
    digest = _sha256(path)
    # JSON by its first character, unless the text is a Megatron-LM log: its lines start with a
    # "[date time]" stamp, so a log cut down to its iteration lines starts with "[" too
    start = text.lstrip()[:1]
    if start == "{" or (start == "[" and not mlm_log.looks_like_log(text)):
        data = _read_json(path, text)
        if isinstance(data, dict) and data.get("schema") == COMPARE_SCHEMA:
            metrics, origin = _from_results(data, path, run)
            kind = "compare-results"
        else:
            if run is not None:
                raise ImportedRunError(f"{path}: run = {run!r} is for a compare results.json")
            metrics, origin = _check_metrics(data, path), {}
            kind = "metrics"
        config = metrics.config
        return Imported(
            metrics,
            config.device,
            bool(config.device_emulated),
            {
                "kind": kind,
                "path": str(path),
                "sha256": digest,
                "versions": config.versions or {},
                **origin,
            },
        )
    if run is not None:
        raise ImportedRunError(f"{path}: run = {run!r} is for a compare results.json")
    if not mlm_log.looks_like_log(text):
        raise ImportedRunError(
            f"{path}: neither a Megatron-LM log (no argument dump, no 'iteration N/ M |' line) "
            "nor JSON nor a TensorBoard event file"
        )
    try:
        parsed = mlm_log.parse(path)
    except mlm_log.LogFormatError as exc:
        raise ImportedRunError(str(exc)) from None
    return Imported(
        mlm_log.to_metrics(parsed, str(path)),
        None,
        False,
        {"kind": "megatron-lm-log", "path": str(path), "sha256": digest},
    )
