"""``results.json``: what ``megatron-npu compare`` writes into its output folder (schema
``megatron-npu/compare``, version 1): every run of the matrix, the verdicts of each candidate
against its references, and the rows of Table 2. The HTML report reads it, and a later compare
imports one of its runs (``import = "results.json"``). ``docs/compare-results.md`` explains the
rules behind the verdicts.

Non-finite numbers are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
(as the parity records write them), and read back as floats.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field
from typing_extensions import Self

from megatron_npu.formats.base import Document, FormatError, Number, Part
from megatron_npu.formats.lambada_result import LambadaResult
from megatron_npu.formats.run_record import COMMAND_DESCRIPTION

SCHEMA = "megatron-npu/compare"
SCHEMA_VERSION = 1


class Provenance(Part):
    """Who wrote the file, where and with what."""

    megatron_npu: str | None = Field(None, description="megatron-npu's version")
    megatron_core: str | None = Field(None, description="megatron-core's version")
    torch: str | None = Field(None, description="torch's version")
    torch_npu: str | None = Field(None, description="torch_npu's version, or null")
    python: str | None = Field(None, description="Python's version")
    commit: str | None = Field(None, description="short git SHA of the checkout, or null")
    dirty: bool | None = Field(None, description="the checkout had uncommitted changes, or null")
    host: str | None = Field(None, description="the machine's host name")
    command: list[str] = Field(default_factory=list, description="the command line (argv)")


class Step(Part):
    """One step of a run's curve."""

    iteration: int = Field(description="the iteration, from 1")
    loss: Number | None = Field(None, description="LM loss; null on a skipped (overflow) step")
    grad_norm: Number | None = Field(None, description="gradient norm before clipping")
    step_time_s: Number | None = Field(None, description="wall seconds of the step")


class Perf(Part):
    """A run's speed and memory, from its steps after ``warmup_steps``."""

    median_s_per_step: Number | None = Field(
        None, description="median seconds per step after warmup_steps"
    )
    ci95_s_per_step: list[Number] | None = Field(
        None,
        description="[lo, hi]: percentile bootstrap of the median (2000 resamples, seed 0)",
    )
    tokens_per_s: Number | None = Field(
        None, description="global batch x sequence length / median s/step"
    )
    model_flops_per_step: Number | None = Field(
        None, description="Megatron-LM's GPT formula (megatron_npu/training/flops.py)"
    )
    mfu: Number | None = Field(
        None,
        description="model FLOPs utilisation at the median, against peak_tflops x the devices "
        "that own a peak; null without a peak, on emulated runs, and above 1 (peak_understated)",
    )
    ci95_mfu: list[Number] | None = Field(
        None, description="[lo, hi]: the MFU at the ends of the s/step interval; null with mfu"
    )
    peak_tflops: Number | None = Field(None, description="the peak one device is measured against")
    peak_source: str | None = Field(
        None,
        description="measured, cached, user, or datasheet (an imported Megatron-LM run on the GPU "
        "its hardware label names: megatron_npu/compare/datasheet.py)",
    )
    peak_understated: bool | None = Field(
        None, description="the run was faster than the peak: mfu is then null"
    )
    mfu_note: str | None = Field(None, description="why there is no MFU (emulated), or null")
    peak_allocated_mib: Number | None = Field(
        None,
        description="the allocator's peak, largest over ranks: max_memory_allocated on cuda/npu "
        "and a Megatron-LM log's 'max allocated' of a cuda/npu run; on cpu and npu-emulated the "
        "profiler's count (megatron_npu/training/host_allocator_peak.py: live tensor storages at "
        "the first step plus that step's net CPU allocations)",
    )
    peak_rss_mib: Number | None = Field(
        None,
        description="the process's peak RSS on cpu and npu-emulated; the only memory figure of a "
        "Megatron-LM log from a run on those devices, and of metrics files written before the "
        "host allocator peak",
    )
    speed_comparable: bool | None = Field(
        None, description="false when emulated: its speed is not NPU performance"
    )


class ImportedFrom(Part):
    """Where an imported run came from."""

    kind: str | None = Field(
        None, description="megatron-lm-log, tensorboard, metrics or compare-results"
    )
    path: str | None = Field(None, description="the imported file or folder")
    sha256: str | None = Field(None, description="first 16 hex digits of the file's SHA-256")
    versions: dict[str, Any] | None = Field(None, description="the versions the file names")
    results: str | None = Field(None, description="compare-results: the results.json read")
    run: str | None = Field(None, description="compare-results: the run taken from it")
    created: str | None = Field(None, description="compare-results: when it was written")
    provenance: dict[str, Any] | None = Field(
        None, description="compare-results: its provenance object"
    )


class Run(Part):
    """One run of the matrix, in matrix order."""

    name: str = Field(description="the matrix run name (a folder name)")
    device: str | None = Field(
        description="cpu, npu, npu-emulated or cuda: the device that ran it (the first available "
        "of the run's list); null if none was available"
    )
    emulated: bool = Field(
        description="true for npu-emulated: never an NPU result, its speed is not NPU performance"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description='train options as given ("flag": value, true = bare flag), after '
        "vocabulary alignment",
    )
    config_hash: str | None = Field(
        None,
        description="16 hex digits: device, exact train argv, rerun index, checkpointing, "
        "library versions",
    )
    fingerprint: dict[str, Any] = Field(
        default_factory=dict,
        description="model shape, padded vocabulary, data, seed, initial weights and tokenizer "
        "the run used; {} for a failed run",
    )
    status: str = Field(
        description="ok, cached (an identical finished run was reused), imported or failed"
    )
    error: str | None = Field(
        None, description="for failed: exit code / signal / timeout and the log's last lines"
    )
    wall_s: Number | None = Field(
        None, description="wall time of the train subprocess (of the original run when cached)"
    )
    command: list[str] = Field(
        default_factory=list,
        description=COMMAND_DESCRIPTION,
    )
    metrics_path: str | None = Field(
        None, description="runs/<name>/metrics.json, relative to the folder"
    )
    steps: list[Step] = Field(description="the run's curve, one entry per step")
    perf: Perf | None = Field(None, description="speed and memory; null for a failed run")
    lambada: LambadaResult | None = Field(
        None,
        description="the LAMBADA evaluation of the final checkpoint ([compare] lambada = true), "
        "else null",
    )
    reference: str | None = Field(
        None, description="the run its verdicts compare against (null for the baseline)"
    )
    kind: str | None = Field(None, description="train, import or script: how the run was obtained")
    hardware: str | None = Field(None, description="the matrix's hardware label")
    imported_from: ImportedFrom | None = Field(None, description="for imports; else null")
    notes: list[str] = Field(
        default_factory=list, description="e.g. a LAMBADA evaluation that failed"
    )


class Verdict(Part):
    """One rule's verdict on a candidate."""

    candidate: str = Field(description="the judged run")
    baseline: str = Field(
        description="what it was judged against: its reference; for performance its "
        "speed_reference, else its reference"
    )
    rule: str = Field(
        description="fingerprint, deterministic, layout, approximate, noise or performance"
    )
    status: str = Field(description="pass, fail, refused or not-applicable")
    detail: str = Field(description="the figures behind the status, in words")
    tolerance: dict[str, Any] = Field(
        default_factory=dict,
        description="the limits used (rtol, mean_rtol, late_window, late_growth, grad_norm_rtol; "
        "per_step_rel; threshold, ci, memory_threshold; vary; factor, floor, reruns, mean_band, "
        "seed_scale of the noise rule)",
    )
    per_step: dict[str, list[Any]] | None = Field(
        None,
        description="{iteration: [...], rel_diff: [...]}: relative loss difference per step, for "
        "plots (the approximate rule adds grad_norm_iteration and grad_norm_rel_diff, the noise "
        "rule band and grad_norm_band); null for rules without a curve",
    )


class Table2Row(Part):
    """One row of Table 2, as printed and written to table2.md (column labels with units:
    megatron_npu.compare.table2.COLUMNS)."""

    name: str | None = Field(None, description="the run")
    device: str | None = Field(None, description="the device, or the run's device list")
    hardware: str | None = Field(None, description="the matrix's hardware label")
    emulated: bool | None = Field(None, description="marked * in the markdown, with a footnote")
    layout: str | None = Field(None, description="TP1 PP1 DP1, plus VPPn, CPn, EPn, SP, distopt")
    precision: str | None = Field(
        None, description="fp32, bf16 or fp16, with (flash), (window P/N), BSH"
    )
    first_loss: Number | None = Field(None, description="the first step's LM loss")
    last_loss: Number | None = Field(None, description="the last step's LM loss")
    s_per_step: Number | None = Field(None, description="median s/step after warmup_steps")
    s_per_step_ci95: list[Number] | None = Field(None, description="its 95 % interval")
    tokens_per_s: Number | None = None
    mfu: Number | None = Field(None, description="null on emulated rows")
    mfu_ci95: list[Number] | None = None
    peak_understated: bool | None = None
    peak_allocated_mib: Number | None = None
    peak_rss_mib: Number | None = None
    cloze_set: str | None = Field(
        None,
        description="lambada for a user's lambada_test.jsonl-format file, corpus-cloze for the "
        "shipped set cut from the embedded corpus; null without an evaluation",
    )
    cloze_accuracy: Number | None = None
    cloze_nll: Number | None = Field(None, description="mean target-token negative log-likelihood")
    noise_band: str | None = Field(
        None,
        description="where the matrix measured a band: 'inside (at most Nx the band)', 'OUTSIDE "
        "from step N (Nx the band)', 'OUTSIDE on the mean', or '<perturb> rerun'",
    )
    verdict: str | None = Field(
        None,
        description="baseline; pass <rule> vs <ref>; FAIL <rule> vs <ref>; REFUSED "
        "(fingerprint); run failed: ...; <perturb> rerun of <ref>; with '; OUTSIDE the rounding "
        "band' and '; SLOWER' appended on a noise or performance fail",
    )


class Skipped(Part):
    """An optional run that was not run here."""

    name: str = Field(description="the matrix run name")
    reason: str = Field(description="why (e.g. none of its devices is available)")


class CompareResults(Document):
    """One comparison: every run of a matrix, the verdicts of each candidate against its
    references, and Table 2."""

    schema_name = "compare-results"
    non_finite = "strings"
    # "schema" would shadow BaseModel.schema: the field is schema_ and the file's key its alias
    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)

    schema_: Literal["megatron-npu/compare"] = Field(
        alias="schema", description="what the file is; readers check it"
    )
    schema_version: Literal[1] = Field(description="the format's version; readers check it")
    matrix: str | None = Field(None, description='the matrix path, or "default"')
    created: str | None = Field(None, description="when it was written: ISO 8601, UTC")
    provenance: Provenance | None = None
    baseline: str | None = Field(None, description="name of the baseline run")
    runs: list[Run] = Field(
        description="in matrix order; optional runs whose device is absent are in skipped"
    )
    verdicts: list[Verdict] = Field(
        description="per candidate: fingerprint, one accuracy rule, noise where the matrix "
        "measured a band, performance"
    )
    table2: list[Table2Row] = Field(
        default_factory=list, description="one row per run, as printed and in table2.md"
    )
    skipped: list[Skipped] = Field(
        default_factory=list,
        description="optional runs not run here (e.g. cuda without a GPU), with the reason",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="what compare changed in the matrix (vocabulary padding alignment)",
    )

    @classmethod
    def parse(cls, data: Any, source: str = "<data>") -> Self:
        """As :meth:`Document.parse`, but a file of another schema or version is that one error
        (not one per field it lacks)."""
        if isinstance(data, dict):
            problem = version_problem(data)
            if problem:
                raise FormatError(source, problem)
        return super().parse(data, source)

    def run(self, name: str) -> Run | None:
        return next((r for r in self.runs if r.name == name), None)


def version_problem(data: dict[str, Any]) -> str | None:
    """Why ``data`` is not a version this code reads, or None."""
    if data.get("schema") != SCHEMA:
        return f"schema: not a compare results file (got {data.get('schema')!r}, not {SCHEMA!r})"
    version = data.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        return (
            f"schema_version: {version!r} is not supported (this version of megatron-npu reads "
            f"{SCHEMA_VERSION})"
        )
    return None


DOCUMENTS = (CompareResults,)
