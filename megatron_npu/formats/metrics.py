"""``metrics.json``: what ``megatron-npu train --metrics-out`` writes (global rank 0, at the end
of the run and when a guard stops it), and what compare makes of a run it imports (a
Megatron-LM log, TensorBoard events), so that every rule reads one shape.

A file the trainer wrote fills every field; an imported run fills what its source says and
leaves the rest null (a Megatron-LM log has no tokens/s per step, TensorBoard no memory).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from megatron_npu.formats.base import Document, Part


class StepRecord(Part):
    """One training step, as Megatron-LM logs it."""

    step: int = Field(description="the iteration, from 1")
    lm_loss: float | None = Field(
        None,
        description="the step's LM loss; null on a skipped (overflow) step or a non-finite loss",
    )
    grad_norm: float | None = Field(None, description="gradient norm before clipping")
    lr: float | None = Field(None, description="learning rate the step used")
    loss_scale: float | None = Field(None, description="fp16 loss scale (1.0 without one)")
    skipped: bool = Field(False, description="the optimizer skipped the step (overflow)")
    step_time_s: float | None = Field(None, description="wall seconds of the step")
    tokens_per_s: float | None = Field(None, description="global tokens / step_time_s")
    params_norm: float | None = Field(
        None, description="norm of the parameters (with --log-params-norm; else absent)"
    )
    moe_aux_losses: dict[str, float | None] | None = Field(
        None,
        description="MoE runs: each auxiliary loss of the step (load_balancing_loss, z_loss, "
        "...), averaged over the MoE layers as Megatron-LM reports it; else absent",
    )

    omit_when_none = frozenset({"params_norm", "moe_aux_losses"})


class RunData(Part):
    source: str | None = Field(None, description="mock, data-path or corpus")
    description: str | None = Field(None, description="what the run trained on, in words")


class RunConfig(Part):
    """The run's configuration: every argument and where it ran."""

    arguments: dict[str, Any] = Field(
        description="every argument of the run, by Megatron-LM's dest name (hidden_size, ...)"
    )
    world_size: int | None = None
    data_parallel_size: int | None = None
    num_microbatches: int | None = None
    device: str | None = Field(
        None, description="the device as the active Device names it (npu-emulated stays so)"
    )
    device_emulated: bool | None = Field(None, description="true for npu-emulated")
    torch_device_type: str | None = None
    dist_backend: str | None = None
    versions: dict[str, str | None] | None = Field(
        None, description="megatron-npu, megatron-core, torch, torch_npu, python"
    )
    data: RunData | None = None
    padded_vocab_size: int | None = Field(None, description="the vocabulary after padding")
    resumed_from: Any = Field(None, description="the checkpoint the run resumed from, or null")


class Peak(Part):
    """A per-device peak (``megatron_npu.training.peak``)."""

    tflops: float
    source: str = Field(description="measured, cached, user or datasheet")
    device: str | None = None
    dtype: str | None = None
    detail: str | None = None


class Stopped(Part):
    """Why ``megatron_npu.training.divergence`` stopped the run."""

    reason: str
    message: str
    iteration: int | None = None
    exit_status: int | None = None


class Summary(Part):
    """The run's figures over all steps (steady state: after the first two steps)."""

    omit_when_none = frozenset({"log_interval", "has_step_times"})

    steps: int | None = None
    steady_state_steps: int | None = None
    median_step_time_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = Field(
        None, description="the allocator's peak, largest over ranks"
    )
    peak_memory_measure: str | None = None
    peak_memory_source: str | None = Field(
        None, description="how the peak was measured (the device's allocator API)"
    )
    peak_rss_bytes: int | None = Field(
        None, description="the process's peak resident set (host devices only)"
    )
    peak_memory_profiled_step: int | None = None
    skipped_steps: int | None = None
    first_lm_loss: float | None = None
    last_lm_loss: float | None = None
    model_flops_per_step: float | None = Field(
        None, description="Megatron-LM's GPT formula (megatron_npu.training.flops)"
    )
    achieved_tflops_per_s: float | None = None
    mfu: float | None = Field(None, description="null above 1 (an understated peak)")
    peak_understated: bool | None = None
    peak: Peak | None = None
    peak_devices: int | None = None
    stopped: Stopped | None = None
    log_interval: int | None = Field(
        None, description="imported Megatron-LM logs: the steps one logged line averages"
    )
    has_step_times: bool | None = Field(
        None, description="imported TensorBoard events: whether step times were logged"
    )


class MetricsFile(Document):
    """A training run: configuration, one record per step, summary."""

    schema_name = "metrics"

    config: RunConfig
    steps: list[StepRecord]
    summary: Summary = Field(default_factory=Summary)


DOCUMENTS = (MetricsFile,)
