"""A TensorBoard event folder written by Megatron-LM as a run's metrics, read with the
``tensorboard`` package's own event reader (``EventAccumulator``; extra ``tensorboard``).

Megatron-LM (``megatron/training/training.py`` ``training_log``, ``initialize.py``
``write_args_to_tensorboard``) writes, every ``--tensorboard-log-interval`` steps, the scalars
``lm loss``, ``grad-norm``, ``learning-rate``, ``loss-scale``, ``batch-size`` and, with
``--log-timers-to-tensorboard``, ``iteration-time`` (seconds per step); and each argument as a
text summary named after it, from which the fingerprint is taken; with ``--log-throughput``,
``throughput`` (TFLOP/s per GPU), which with ``iteration-time`` gives the step's model FLOPs
(else Megatron-LM's formula over the arguments: :func:`.mlm_log.model_flops`, one count for logs
and event folders). A curve needs ``lm loss``; step times need ``iteration-time``. Every problem is
an :class:`EventFolderError` naming the folder (or file).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from megatron_npu.compare import mlm_log
from megatron_npu.formats.metrics import MetricsFile

LOSS, GRAD_NORM, ITERATION_TIME = "lm loss", "grad-norm", "iteration-time"
LEARNING_RATE, LOSS_SCALE, THROUGHPUT = "learning-rate", "loss-scale", "throughput"


class EventFolderError(ValueError):
    """An event folder that cannot be read as Megatron-LM's TensorBoard output; names it."""


def event_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if "tfevents" in path.name else []
    return sorted(p for p in path.rglob("*tfevents*") if p.is_file())


def _text(value: Any) -> Any:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def check_records(file: Path) -> int:
    """Walk every record with tensorboard's own record reader: the event accumulator stops
    silently at a truncated or corrupt record (a shorter curve); here that is an error naming
    the record. Returns the number of records."""
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow

    reader = pywrap_tensorflow.PyRecordReader_New(str(file), 0)
    count = 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return count
        except errors.DataLossError as exc:
            reason = str(getattr(exc, "message", exc)).replace(str(file), "").strip()
            raise EventFolderError(
                f"{file}: record {count + 1} is truncated or corrupt ({reason}), "
                f"after {count} good ones"
            ) from None
        count += 1


def read(path: str | Path) -> dict[str, Any]:
    """``{"arguments", "scalars": {tag: {step: value}}}`` of the folder's events."""
    path = Path(path)
    if not path.exists():
        raise EventFolderError(f"{path}: no such file or folder")
    files = event_files(path)
    if not files:
        raise EventFolderError(f"{path}: no TensorBoard event file (*tfevents*) in it")
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.util import tensor_util
    except ImportError:
        raise EventFolderError(
            f"{path}: reading TensorBoard events needs the tensorboard package "
            "(pip install 'megatron-npu[tensorboard]')"
        ) from None
    scalars: dict[str, dict[int, float]] = {}
    arguments: dict[str, Any] = {}
    for file in files:
        if file.stat().st_size == 0:
            raise EventFolderError(f"{file}: empty event file")
        check_records(file)
        accumulator = EventAccumulator(str(file), size_guidance={"scalars": 0, "tensors": 0})
        try:
            accumulator.Reload()
        except Exception as exc:  # the reader's own errors: corrupt records, bad CRCs
            raise EventFolderError(
                f"{file}: not a readable event file ({type(exc).__name__}: {exc})"
            ) from None
        tags = accumulator.Tags()
        for tag in tags.get("scalars", []):
            for event in accumulator.Scalars(tag):
                scalars.setdefault(tag, {})[int(event.step)] = float(event.value)
        for tag in tags.get("tensors", []):
            events = accumulator.Tensors(tag)
            if not events:
                continue
            try:
                value = tensor_util.make_ndarray(events[-1].tensor_proto)
            except Exception:  # not a text summary: not an argument
                continue
            if value.dtype.kind in ("S", "O", "U") and value.size == 1:
                arguments.setdefault(tag.split("/")[0], _text(value.reshape(-1)[0]))
            elif value.dtype.kind in ("f", "i") and value.size == 1:
                for event in events:
                    number = float(tensor_util.make_ndarray(event.tensor_proto).reshape(-1)[0])
                    scalars.setdefault(tag, {})[int(event.step)] = number
    if LOSS not in scalars:
        found = ", ".join(sorted(scalars)) or "no scalars"
        raise EventFolderError(
            f"{path}: no {LOSS!r} scalar (found: {found}): not Megatron-LM's TensorBoard output, "
            "or a truncated one"
        )
    return {"arguments": arguments, "scalars": scalars}


def to_metrics(events: dict[str, Any], source: str) -> MetricsFile:
    """The events in the shape of ``megatron-npu train --metrics-out`` (config, steps, summary)."""
    args = events["arguments"]
    scalars = events["scalars"]
    losses = scalars[LOSS]
    times = scalars.get(ITERATION_TIME, {})
    lr_used = mlm_log.lr_each_step_used(scalars.get(LEARNING_RATE, {}), losses)
    steps = [
        {
            "step": step,
            "lm_loss": losses[step],
            "grad_norm": scalars.get(GRAD_NORM, {}).get(step),
            "lr": lr_used[step],  # the rate the step used (Megatron-LM logs the next one's)
            "loss_scale": scalars.get(LOSS_SCALE, {}).get(step),
            # no time logged for this step (no --log-timers-to-tensorboard, or the first step):
            # NaN, which the timing statistics leave out
            "skipped": False,
            "step_time_s": times.get(step, float("nan")),
        }
        for step in sorted(losses)
    ]
    world = args.get("world_size")
    # Megatron-LM's --log-throughput scalar (TFLOP/s per GPU) over the step's iteration-time
    throughput = scalars.get(THROUGHPUT, {})
    counted = [
        {"tflops_per_gpu": throughput[s], "step_time_ms": times[s] * 1000.0}
        for s in sorted(throughput)
        if s in times
    ]
    tp = args.get("tensor_model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    document = {
        "config": {
            "arguments": args,
            "world_size": world,
            "data_parallel_size": args.get("data_parallel_size")
            or (world // (tp * pp) if isinstance(world, int) else None),
            "padded_vocab_size": args.get("padded_vocab_size"),
            "data": {
                "source": "mock" if args.get("mock_data") else "data-path",
                "description": mlm_log.data_description(
                    args, "Megatron-LM TensorBoard events", source
                ),
            },
        },
        "steps": steps,
        "summary": {
            "steps": len(steps),
            "first_lm_loss": steps[0]["lm_loss"] if steps else None,
            "last_lm_loss": steps[-1]["lm_loss"] if steps else None,
            "peak_memory_bytes": None,
            "has_step_times": bool(times),
            "model_flops_per_step": mlm_log.model_flops(
                counted, args, args.get("padded_vocab_size"), world
            ),
        },
    }
    return MetricsFile.parse(document, source)
