"""What a run reports: per-step records, the ``--metrics-out`` JSON, console lines, progress.

The JSON (written by global rank 0 only, atomically: temp file + ``os.replace``; its model is
:class:`megatron_npu.formats.metrics.MetricsFile`, schema ``docs/schemas/metrics.schema.json``)
has

* ``config``: every argument, the world size, the device *as the active Device names it*
  (``npu-emulated`` stays ``npu-emulated``), whether it is emulated, and library versions;
* ``steps``: one object per step -- ``step, lm_loss, grad_norm, lr, loss_scale, skipped,
  step_time_s, tokens_per_s`` (+ ``params_norm`` with ``--log-params-norm``; + ``moe_aux_losses``,
  ``{name: value}``, with ``--num-experts``: Megatron-LM's per-step figures, averaged over the
  MoE layers);
* ``summary``: median steady-state seconds per step (steps after the first
  :data:`WARMUP_STEPS`; all steps if there are no others), tokens/s at that median, the
  allocator's peak memory, the largest over all ranks (``peak_memory_bytes``, measure
  ``allocator``: ``max_memory_allocated`` on cuda/npu; on cpu and npu-emulated the first step
  measured by :mod:`.host_allocator_peak`, with ``peak_memory_source`` saying which) and, on the
  host, the process's peak resident set (``peak_rss_bytes``), skipped steps;
  and throughput: ``model_flops_per_step`` (Megatron-LM's GPT formula, :mod:`.flops`),
  ``achieved_tflops_per_s`` at the median step time, ``mfu`` against ``peak`` (the per-device
  peak of :mod:`.peak` -- measured GEMM probe, cached, or stated -- times ``peak_devices``; null
  with ``peak_understated: true`` when the model ran faster than that peak); ``stopped``: null,
  or why :mod:`.divergence` stopped the run (``reason``, ``message``, ``iteration``,
  ``exit_status`` 3).

The loss lives on the last pipeline stage; :mod:`megatron_npu.training.loop` sums it onto every
rank with one all-reduce per step (see ``loop.reduce_loss``), so rank 0 writes it here.

Console: every ``--log-interval`` steps rank 0 prints Megatron-LM's line
(`` iteration        5/      20 | consumed samples: ... |``); the progress display is a rich bar
on a TTY and a plain ``[progress]`` line otherwise.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_npu import console
from megatron_npu.formats.metrics import MetricsFile, StepRecord
from megatron_npu.training.peak import plausible

#: Steps excluded from the steady-state timing (start-up, first allocations, warm caches).
WARMUP_STEPS = 2


@dataclass
class RunMetrics:
    config: dict[str, Any]
    tokens_per_step: int
    steps: list[StepRecord] = field(default_factory=list)
    peak_memory_bytes: int | None = None  # the allocator's peak, largest over ranks
    peak_memory_source: str | None = None  # how it was measured (the device's allocator API)
    peak_rss_bytes: int | None = None  # the process's peak resident set (host devices only)
    profiled_step: int | None = None  # the step run under the profiler (its time is inflated)
    model_flops_per_step: float | None = None
    peak: dict[str, Any] | None = None  # PeakFlops.as_dict()
    peak_devices: int = 1
    stopped: dict[str, Any] | None = None  # why the run was stopped (training.divergence)

    def throughput(
        self, step_time_s: float | None, raw: bool = False
    ) -> tuple[float | None, float | None]:
        """Achieved model TFLOP/s and MFU at ``step_time_s`` (None where not known, and MFU None
        above 1 -- an understated peak -- unless ``raw``)."""
        if not step_time_s or self.model_flops_per_step is None:
            return None, None
        tflops = self.model_flops_per_step / step_time_s / 1e12
        if not self.peak or not self.peak.get("tflops"):
            return tflops, None
        utilisation = tflops / (self.peak["tflops"] * self.peak_devices)
        return tflops, utilisation if raw else plausible(utilisation)

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)

    def summary(self) -> dict[str, Any]:
        times = [r.step_time_s for r in self.steps]
        steady = times[WARMUP_STEPS:] or times
        median = statistics.median(steady) if steady else None
        losses = [r.lm_loss for r in self.steps if r.lm_loss is not None and not r.skipped]
        return {
            "steps": len(self.steps),
            "steady_state_steps": len(steady),
            "median_step_time_s": median,
            "tokens_per_s": (self.tokens_per_step / median) if median else None,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_measure": "allocator" if self.peak_memory_bytes is not None else None,
            "peak_memory_source": self.peak_memory_source,
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_memory_profiled_step": self.profiled_step,
            "skipped_steps": sum(1 for r in self.steps if r.skipped),
            "first_lm_loss": losses[0] if losses else None,
            "last_lm_loss": losses[-1] if losses else None,
            "model_flops_per_step": self.model_flops_per_step,
            "achieved_tflops_per_s": self.throughput(median)[0],
            "mfu": self.throughput(median)[1],
            "peak_understated": (self.throughput(median, raw=True)[1] or 0.0) > 1.0,
            "peak": self.peak,
            "peak_devices": self.peak_devices,
            "stopped": self.stopped,
        }

    def document(self) -> MetricsFile:
        """The ``--metrics-out`` file (:class:`megatron_npu.formats.metrics.MetricsFile`)."""
        return MetricsFile(config=self.config, steps=self.steps, summary=self.summary())

    def write(self, path: str) -> None:
        """Atomically (a reader sees the old file or the new one, never half of one), and as
        strict JSON: a NaN/inf loss or norm (a diverged step) is written as ``null``."""
        self.document().write(path)


def run_config(args: Any, device: Any) -> dict[str, Any]:
    """The ``config`` block: all arguments plus world size, device and library versions."""
    from megatron_npu.versions import library_versions

    arguments = {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_")}
    return {
        "arguments": _jsonable(arguments),
        "world_size": args.world_size,
        "data_parallel_size": args.data_parallel_size,
        "num_microbatches": args.num_microbatches,
        "device": device.name,
        "device_emulated": bool(device.emulated),
        "torch_device_type": device.torch_type,
        "dist_backend": device.dist_backend,
        "versions": library_versions(),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _fmt_or_nan(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "nan"


def log_line(
    *,
    step: int,
    train_iters: int,
    consumed_samples: int,
    ms_per_step: float,
    lr: float,
    global_batch_size: int,
    lm_loss: float | None,
    loss_scale: float,
    grad_norm: float | None,
    params_norm: float | None,
    skipped: int,
    tflops_per_s: float | None = None,
    mfu: float | None = None,
) -> str:
    """One Megatron-LM training log line (values averaged over the log interval)."""
    line = f" iteration {step:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {ms_per_step:.1f} |"
    if tflops_per_s is not None:
        line += f" model TFLOP/s: {tflops_per_s:.4g} |"
    if mfu is not None:
        line += f" MFU: {100.0 * mfu:.2f}% |"
    line += f" learning rate: {lr:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    line += f" lm loss: {_fmt_or_nan(lm_loss, '.6E')} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    return line


class IntervalLog:
    """Accumulates steps between console lines (Megatron averages over the interval)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def line(
        self,
        train_iters: int,
        consumed_samples: int,
        global_batch_size: int,
        run: RunMetrics | None = None,
    ) -> str:
        records, self.records = self.records, []
        last = records[-1]
        applied = [r for r in records if not r.skipped and r.lm_loss is not None]
        loss = sum(r.lm_loss for r in applied) / len(applied) if applied else None
        mean_step = sum(r.step_time_s for r in records) / len(records)
        tflops, mfu = run.throughput(mean_step) if run is not None else (None, None)
        return log_line(
            step=last.step,
            train_iters=train_iters,
            consumed_samples=consumed_samples,
            ms_per_step=1000.0 * mean_step,
            tflops_per_s=tflops,
            mfu=mfu,
            lr=last.lr,
            global_batch_size=global_batch_size,
            lm_loss=loss,
            loss_scale=last.loss_scale,
            grad_norm=last.grad_norm,
            params_norm=last.params_norm,
            skipped=sum(1 for r in records if r.skipped),
        )


class Progress:
    """A rich progress bar on a TTY; plain ``[progress]`` lines otherwise; or nothing."""

    def __init__(self, mode: str, total: int, start: int = 0) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.total = total
        self.start = start
        self.started = time.perf_counter()
        self._bar = None
        self._task = None
        if mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                transient=False,
                console=console.stdout(),
            )
            self._task = self._bar.add_task("train", total=total, completed=start, loss="")
            self._bar.start()
            console.bar_live(True)

    def print(self, line: str) -> None:
        """One line; above the bar while it is live (the bar draws on the console that says it)."""
        console.say(line)

    def update(self, step: int, lm_loss: float | None, log_now: bool) -> None:
        loss = f"lm loss {lm_loss:.4f}" if lm_loss is not None else ""
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss)
        elif self.mode == "plain" and log_now:
            done = step - self.start
            elapsed = time.perf_counter() - self.started
            eta = elapsed / done * (self.total - step) if done else 0.0
            console.say(
                f" [progress] {step}/{self.total} steps ({100.0 * step / self.total:.0f}%) | "
                f"elapsed {elapsed:.1f}s | eta {eta:.1f}s"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            console.bar_live(False)
            self._bar = None
