"""A Megatron-LM training log (``pretrain_gpt.py`` of releases 0.13-0.19) as a run's metrics.

What is read (``megatron/training/training.py`` ``training_log`` and ``arguments.py``
``_print_args``):

* the argument dump printed at start, between ``---- arguments ----`` and ``---- end of
  arguments ----``: one ``  name ....... value`` line per argument, the value as ``str()`` gives
  it -- the run's fingerprint (:mod:`.fingerprint`) is taken from these;
* `` > padded vocab (size: V) with D dummy tokens (new size: P)`` -- the padded vocabulary;
* every ``iteration N/ M | key: value | ...`` line (``print_rank_last``): ``elapsed time per
  iteration (ms)``, ``learning rate``, ``global batch size``, ``lm loss`` (absent on an interval
  of skipped steps), ``loss scale``, ``grad norm``, ``number of skipped iterations``; values are
  averages over the ``--log-interval`` steps up to N, so a step of the curve is one logged line.
  From release 0.16 a process also logs its first iteration and does not restart its sums
  there, so its next line averages over both intervals (with ``--log-interval 1``: iteration 2's
  loss is the mean of iterations 1 and 2); the importer takes the first line's share back out
  of that line's loss, step time, throughput and skipped count (:func:`_undo_first_line_sums`),
  for each process whose argument dump the log holds;
* the ``learning rate`` of line ``N`` is the rate after iteration ``N``'s scheduler step, the
  one iteration ``N + 1`` uses; a metrics file's ``lr`` is the rate its step used, so step ``N``
  takes line ``N - 1``'s (:func:`lr_each_step_used`; the same for TensorBoard's
  ``learning-rate``);
* ``[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated: ...`` -- the
  peak of ``torch.cuda.max_memory_allocated`` (largest over ranks and lines): the allocator's on
  a GPU, the process's RSS where the adaptor ran it on cpu.

Other lines, line prefixes (torchrun's ``[rank3]:``/``[default0]:``, Slurm's ``srun --label``
``0:``, pdsh's ``node:``, OpenMPI's ``[1,0]<stdout>:``, a timestamp per line: whatever stands
before the argument header's dashes) and the output of several ranks interleaved line by line
are allowed. The same iteration logged twice with the same figures
(several ranks, or a restart that repeats lines) counts once; with other figures it is an error.
Every problem is a :class:`LogFormatError` naming the file and line.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_npu.compare.textfile import read_text
from megatron_npu.formats.metrics import MetricsFile

ARGS_START = re.compile(r"-{3,} arguments -{3,}")
ARGS_END = re.compile(r"-{3,} end of arguments -{3,}")
#: one argument as ``_print_args`` writes it: ``'  {} {} {}'.format(name, dots, value)``, the
#: dots ``'.' * (48 - len(name))`` (none for a name of 48 characters or more)
ARG_LINE = re.compile(r"^  ([A-Za-z_]\w*) (\.*) (.*)$")
#: the same, found anywhere in a line whose prefix is not the argument header's (a timestamp
#: of varying width per line); the dot count tells an argument from other text
ARG_IN_LINE = re.compile(r"\s ([A-Za-z_]\w*) (\.*) (.*)$")
ARG_NAME_WIDTH = 48
ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|(.*)$")
PADDED_VOCAB = re.compile(
    r"padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)"
)
MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) "
    r"\| allocated: ([\d.eE+-]+) \| max allocated: ([\d.eE+-]+)"
)
#: The last field Megatron-LM writes on every iteration line: a line without it is cut short.
LAST_FIELD = "number of skipped iterations"
#: the absolute rounding of a logged value beyond what its float holds: Megatron-LM prints the
#: grad norm as ``{:.3f}`` (the loss as ``{:.6E}``, relative 5e-7, below any tolerance here)
PRINTED_RESOLUTION = {"grad_norm": 5e-4}
FIELDS = {
    "elapsed time per iteration (ms)": "step_time_ms",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "lm_loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
    "consumed samples": "consumed_samples",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
}


#: arguments every release from 0.16 prints in its dump and 0.13-0.15 do not: the releases whose
#: ``training_log`` keeps its sums over the first logged iteration (``should_reset``)
FIRST_LINE_SUMS_MARKERS = ("allow_ambiguous_pad_tokens", "fake_process_group")


class LogFormatError(ValueError):
    """A log that cannot be read as a Megatron-LM training log; names the file and line."""


def looks_like_log(text: str) -> bool:
    return bool(ITERATION.search(text)) or bool(ARGS_START.search(text))


def _argument(line: str, prefix: str) -> tuple[str, str] | None:
    """``(name, value text)`` of an argument-dump line whose header line began with ``prefix``,
    or None for another line (another rank's output inside the dump)."""
    for match in (ARG_LINE.match(line[len(prefix) :]), ARG_IN_LINE.search(line)):
        if match and len(match.group(2)) == max(ARG_NAME_WIDTH - len(match.group(1)), 0):
            return match.group(1), match.group(3)
    return None


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def _number(path: Path, number: int, key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise LogFormatError(
            f"{path}:{number}: {key!r} is not a number: {text.strip()!r}"
        ) from None


def _iteration(path: Path, number: int, match: re.Match) -> dict[str, Any]:
    record: dict[str, Any] = {"iteration": int(match.group(1)), "train_iters": int(match.group(2))}
    rest = match.group(3)
    if LAST_FIELD not in rest:
        raise LogFormatError(
            f"{path}:{number}: iteration line cut short (no {LAST_FIELD!r} field): truncated log?"
        )
    for part in rest.split("|"):
        key, sep, value = part.partition(":")
        key = key.strip()
        if not sep or key not in FIELDS:
            continue
        record[FIELDS[key]] = _number(path, number, key, value)
    if "step_time_ms" not in record:
        raise LogFormatError(
            f"{path}:{number}: iteration line without 'elapsed time per iteration (ms)'"
        )
    return record


def _undo_first_line_sums(first: dict[str, Any], nxt: dict[str, Any]) -> None:
    """Turn ``nxt``, the line after a process's first logged iteration, into what it says about
    its own interval alone. Megatron-LM 0.16+ logs iteration ``f`` (the process's first) and keeps
    its sums, so line ``n`` averages the loss over the advanced iterations of ``f..n``, the step
    time over all ``n - f + 1`` of them, and counts the skipped ones of ``f..n``."""
    total = nxt["iteration"] - first["iteration"] + 1
    skipped_first = first.get("skipped", 0.0)
    advanced = total - nxt.get("skipped", 0.0)  # the advanced iterations of f..n
    if "skipped" in nxt:
        nxt["skipped"] = max(0.0, nxt["skipped"] - skipped_first)
    if "nan" in nxt and "nan" in first:
        nxt["nan"] = max(0.0, nxt["nan"] - first["nan"])
    if "step_time_ms" in first and total > 1:
        time = (nxt["step_time_ms"] * total - first["step_time_ms"]) / (total - 1)
        if nxt.get("tflops_per_gpu"):  # Megatron-LM's throughput is FLOPs over that step time
            nxt["tflops_per_gpu"] *= nxt["step_time_ms"] / time
        nxt["step_time_ms"] = time
    # a skipped first iteration added no loss to the sums: the line's loss is its own already
    if "lm_loss" in nxt and "lm_loss" in first and not skipped_first:
        if advanced > 1:
            nxt["lm_loss"] = (nxt["lm_loss"] * advanced - first["lm_loss"]) / (advanced - 1)
        else:  # every iteration after the first was skipped: no loss of its own
            del nxt["lm_loss"]


def parse(path: str | Path) -> dict[str, Any]:
    """``{"arguments", "padded_vocab_size", "iterations": [records], "peak_allocated_mb"}``."""
    path = Path(path)
    text = read_text(path, LogFormatError, "text log")
    arguments: dict[str, Any] | None = None
    in_args = False
    args_line = 0
    prefix = ""  # what stands before the argument header's dashes
    padded = tokenizer_vocab = None
    peak_mb = None
    records: dict[int, tuple[int, dict[str, Any]]] = {}
    #: per process (each prints an argument dump), the iterations it logged, in order
    processes: list[list[int]] = [[]]
    for number, line in enumerate(text.splitlines(), 1):
        if in_args:
            if ARGS_END.search(line):
                in_args = False
                continue
            found = _argument(line, prefix)
            if found:
                arguments.setdefault(found[0], _value(found[1]))
            continue
        header = ARGS_START.search(line)
        if header:
            if arguments is None:
                arguments, in_args, args_line = {}, True, number
                prefix = line[: header.start()]
            if processes[-1]:
                processes.append([])
            continue
        match = ITERATION.search(line)
        if match:
            record = _iteration(path, number, match)
            seen = records.get(record["iteration"])
            if seen is not None and seen[1] != record:
                raise LogFormatError(
                    f"{path}:{number}: iteration {record['iteration']} is logged again with other "
                    f"figures than at line {seen[0]} (two runs in one log?)"
                )
            if seen is None:
                processes[-1].append(record["iteration"])
            records.setdefault(record["iteration"], (number, record))
            continue
        match = PADDED_VOCAB.search(line)
        if match:
            tokenizer_vocab, padded = int(match.group(1)), int(match.group(3))
            continue
        match = MEMORY.search(line)
        if match:
            value = float(match.group(4))
            peak_mb = value if peak_mb is None else max(peak_mb, value)
    if in_args:
        raise LogFormatError(f"{path}:{args_line}: the argument dump never ends: truncated log?")
    if arguments is None:
        raise LogFormatError(
            f"{path}: no argument dump ('---- arguments ----'): not a Megatron-LM training log, "
            "or its start is missing (the fingerprint is read from it)"
        )
    if not arguments:
        raise LogFormatError(
            f"{path}:{args_line}: the argument dump holds no line that reads as Megatron-LM's "
            "'  name ....... value'"
        )
    if not records:
        raise LogFormatError(
            f"{path}: no 'iteration N/ M | ...' lines after the argument dump: "
            "the run logged no step"
        )
    if any(marker in arguments for marker in FIRST_LINE_SUMS_MARKERS):
        for logged in processes:
            if len(logged) >= 2:
                _undo_first_line_sums(records[logged[0]][1], records[logged[1]][1])
    return {
        "arguments": arguments,
        "padded_vocab_size": padded,
        "tokenizer_vocab_size": tokenizer_vocab,
        "iterations": [records[i][1] for i in sorted(records)],
        "peak_allocated_mb": peak_mb,
    }


def data_description(
    args: dict[str, Any], what: str, source: str, tokenizer_vocab: int | None = None
) -> str:
    """Megatron-LM's mock data, described by its tokenizer's size as ``train`` describes its own:
    the size the log printed (``padded vocab (size: N)``), else the NullTokenizer that
    ``--vocab-size`` builds on the installed megatron-core (the log does not say its release)."""
    if args.get("mock_data") and isinstance(args.get("vocab_size"), int):
        if tokenizer_vocab is None:
            from megatron_npu.data.tokenizers import null_tokenizer

            tokenizer_vocab = int(null_tokenizer(args["vocab_size"]).vocab_size)
        return f"MockGPTDataset, vocab {tokenizer_vocab} ({what} {source})"
    return f"{what} {source}"


def model_flops(
    records: list[dict[str, Any]], args: dict[str, Any], vocab: Any, world: Any
) -> float | None:
    """The model FLOPs of one step: from the run's own ``throughput per GPU (TFLOP/s/GPU)``
    (Megatron-LM's count over the step time and the world; ``records`` hold ``tflops_per_gpu``
    and ``step_time_ms`` per step, from a log's lines or TensorBoard's scalars) when it logged
    it (the median over its steps), else Megatron-LM's formula over the argument dump; None when
    neither can be had."""
    logged = [
        r["tflops_per_gpu"] * 1e12 * world * r["step_time_ms"] / 1000.0
        for r in records
        if r.get("tflops_per_gpu") and r.get("step_time_ms") and isinstance(world, int)
    ]
    if logged:
        return float(sorted(logged)[len(logged) // 2])
    from megatron_npu.training import flops

    try:
        return flops.model_flops_per_step(args, int(vocab))
    except (TypeError, ValueError):  # an argument the formula needs is not in the dump
        return None


def lr_each_step_used(
    logged: dict[int, float | None], steps: Iterable[int]
) -> dict[int, float | None]:
    """The learning rate each of ``steps`` used, from the rates Megatron-LM ``logged`` per
    iteration. At iteration ``N`` it logs the rate after ``N``'s scheduler step
    (``training_log`` reads the optimizer's param groups after ``train_step``): the rate
    iteration ``N + 1`` uses. Step ``N`` used the one logged at ``N - 1``; None where that
    iteration was not logged (the first step, steps between log intervals)."""
    return {step: logged.get(step - 1) for step in steps}


def to_metrics(parsed: dict[str, Any], source: str) -> MetricsFile:
    """The parsed log in the shape of ``megatron-npu train --metrics-out`` (config, steps,
    summary), so that compare's rules read it like a local run."""
    args = dict(parsed["arguments"])
    records = parsed["iterations"]
    lr_used = lr_each_step_used(
        {rec["iteration"]: rec.get("lr") for rec in records}, (rec["iteration"] for rec in records)
    )
    steps = []
    for rec in records:
        skipped = bool(rec.get("skipped")) or "lm_loss" not in rec
        steps.append(
            {
                "step": rec["iteration"],
                "lm_loss": None if skipped else rec.get("lm_loss"),
                "grad_norm": rec.get("grad_norm"),
                "lr": lr_used[rec["iteration"]],
                "loss_scale": rec.get("loss_scale"),
                "skipped": skipped,
                "step_time_s": rec["step_time_ms"] / 1000.0,
            }
        )
    losses = [s["lm_loss"] for s in steps if s["lm_loss"] is not None]
    world = args.get("world_size")
    tp = args.get("tensor_model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    dp = args.get("data_parallel_size") or (world // (tp * pp) if isinstance(world, int) else None)
    data_source = "mock" if args.get("mock_data") else "data-path"
    peak = parsed.get("peak_allocated_mb")
    vocab = parsed.get("padded_vocab_size") or args.get("padded_vocab_size")
    document = {
        "config": {
            "arguments": args,
            "world_size": world,
            "data_parallel_size": dp,
            "padded_vocab_size": parsed.get("padded_vocab_size") or args.get("padded_vocab_size"),
            "data": {
                "source": data_source,
                "description": data_description(
                    args, "Megatron-LM log", source, parsed.get("tokenizer_vocab_size")
                ),
            },
        },
        "steps": steps,
        "summary": {
            "steps": len(steps),
            "first_lm_loss": losses[0] if losses else None,
            "last_lm_loss": losses[-1] if losses else None,
            # what torch.cuda.max_memory_allocated measured on the run's device (through the
            # adaptor on cpu/npu-emulated that is the process's peak RSS): the memory measure
            # of the run's device (megatron_npu.devices.facts) says which column it belongs to
            "peak_memory_bytes": int(peak * 2**20) if peak is not None else None,
            "log_interval": args.get("log_interval"),
            "model_flops_per_step": model_flops(parsed["iterations"], args, vocab, world),
        },
    }
    return MetricsFile.parse(document, source)
