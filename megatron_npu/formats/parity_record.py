"""The parity record: one JSON file per (patch, case, dtype, parallel sizes, device) cell.

The parity harness writes it (``megatron_npu.parity.results.write_record``); the harness's own
reader (``read_records``, which stops at the first bad file) and the report
(``megatron_npu.reports.parity_records``, which lists a bad file as skipped) read it. What the
metrics mean and how a verdict is reached: ``docs/parity-results.md``.

Non-finite numbers are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
(strict JSON), keys sorted, 2-space indent. Versions 1 and 2 are still read: a schema-1 record
has no ``kernels``, ``npu_kernel_exercised`` and ``benchmark`` keys and no ``rel_l2*`` /
``small_value_atol`` metrics; a schema-1 or -2 record has no ``parallel.cp`` (read as 1).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from typing_extensions import Self

from megatron_npu.devices.facts import DEVICE_ORDER, NPU, NPU_EMULATED
from megatron_npu.formats.base import Document, FieldError, Part

#: the version the harness writes; bumped when a key is added, removed or changes meaning
SCHEMA_VERSION = 3
#: the versions the readers accept
READABLE_VERSIONS = (1, 2, 3)
_READABLE = ", ".join(map(str, READABLE_VERSIONS[:-1])) + f" or {READABLE_VERSIONS[-1]}"
#: the first version whose ``parallel`` has the context-parallel size (older records ran CP 1)
CP_SCHEMA = 3
#: verdict statuses, in increasing severity
STATUSES = ("pass", "warning", "error")
SEVERITY = {s: i for i, s in enumerate(STATUSES)}
#: the keys of ``parallel``, in the order file names and labels list them
PARALLEL_KEYS = ("tp", "pp", "dp", "cp", "world")
#: the dtypes a cell runs in (the names of ``megatron_npu.parity.metrics.DTYPE_CONFIGS``)
DTYPES = ("float16", "bfloat16", "float32")
#: device labels, in the order results list them. "npu" only for a real Ascend NPU through
#: torch_npu; the CPU emulation of torch_npu's kernels is "npu-emulated", never "npu".
DEVICES = DEVICE_ORDER
#: verdict rules of a record that compared nothing (the cell failed before any comparison)
NO_TENSOR_RULES = ("crash", "timeout", "reference_hygiene")
#: the N of the dual-N shares a Tolerance may pick, by name (megatron_npu.parity.metrics)
DUAL_LEVEL_NAMES = {"hundredth": 1e-2, "thousandth": 1e-3, "ten_thousandth": 1e-4}
DUAL_LEVELS = tuple(DUAL_LEVEL_NAMES.values())
#: msprobe's accuracy levels of the stage-2 benchmark (megatron_npu.parity.benchmark)
BENCHMARK_LEVELS = ("L0", "L1", "L2")

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError('must be a number or "NaN", "Infinity", "-Infinity"')
    return value


#: a float; non-finite ones are the strings "NaN", "Infinity", "-Infinity" in the file
Float = Annotated[
    float,
    BeforeValidator(_number),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": list(_NON_FINITE)}]}),
]
Size = Annotated[StrictInt, Field(ge=1)]
Name = Annotated[StrictStr, Field(min_length=1)]


def check_tolerance(
    reason: Any,
    cosine: float | None,
    abs_pass: float | None,
    dual_error: float | None,
    dual_warning: float | None,
    rel_l2: float | None,
) -> None:
    """The rules of a Tolerance override (``megatron_npu.parity.verdict.Tolerance`` checks them
    when a case builds one, :class:`Tolerance` when a record is read); ValueError names the
    field."""
    if not isinstance(reason, str) or not reason.strip():
        raise FieldError("reason", "a Tolerance override needs a written reason")
    thresholds = {
        "cosine": cosine,
        "abs_pass": abs_pass,
        "dual_error": dual_error,
        "dual_warning": dual_warning,
        "rel_l2": rel_l2,
    }
    if all(v is None for v in thresholds.values()):
        raise FieldError("cosine", "a Tolerance override must change at least one threshold")
    if cosine is not None and not -1.0 <= cosine < 1.0:
        raise FieldError("cosine", f"Tolerance.cosine must be in [-1, 1), got {cosine}")
    for name in ("abs_pass", "rel_l2"):
        value = thresholds[name]
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise FieldError(name, f"Tolerance.{name} must be a positive number, got {value}")
    for name in ("dual_error", "dual_warning"):
        value = thresholds[name]
        if value is not None and value not in DUAL_LEVELS:
            raise FieldError(
                name, f"Tolerance.{name} must be one of {sorted(DUAL_LEVELS)}, got {value}"
            )


class Verdict(Part):
    """A verdict of one tensor, or of the record (the worst tensor's)."""

    status: Literal[STATUSES] = Field(description="pass, warning or error (increasing severity)")
    reason: StrictStr = Field(
        description="one sentence naming the deciding rule and its numbers, e.g. `cosine 0.97 "
        "<= 0.99`; ends with `[tolerance override: <reason>]` when an override was in effect. "
        "The record's verdict prefixes the tensor's reason with `<tensor>: `; a failed cell's "
        "is `<rule>: <exception text, last 2000 characters>`"
    )
    rule: StrictStr = Field(
        description="the deciding rule: exact, inf_nan, empty, cosine, rel_l2, max_abs, "
        "dual_hundredth, dual_thousandth, dual_ten_thousandth, benchmark; for a failed cell "
        "crash, timeout or reference_hygiene"
    )
    override: StrictBool = Field(description="a Tolerance was in effect")


class TensorMetrics(Part):
    """msprobe's accuracy metrics of one output tensor (definitions: docs/parity-results.md,
    *Metrics*); null where a metric does not apply (every float metric of an exact tensor)."""

    kind: Literal["float", "exact"] = Field(
        description="float (msprobe metrics) or exact (integer/bool tensors: equality only)"
    )
    dtype: StrictStr = Field(description="the dtype the rules use (the cell's dtype)")
    actual_dtype: StrictStr = Field(description="storage dtype of the tested output")
    reference_dtype: StrictStr = Field(description="storage dtype of the reference")
    actual_shape: list[StrictInt]
    reference_shape: list[StrictInt]
    numel: StrictInt = Field(description="number of elements")
    compared_count: StrictInt = Field(description="positions where both sides are finite")
    nonfinite_match_count: StrictInt = Field(
        description="positions where both are NaN or the same inf"
    )
    inf_nan_mismatch_count: StrictInt = Field(
        description="other positions where either side is non-finite (an error)"
    )
    exact_mismatch_count: StrictInt | None = Field(
        description="exact kind: elements that differ; null for float"
    )
    cosine: Float | None = Field(description="msprobe's cosine; null for a single element")
    max_abs_error: Float | None
    max_rel_error: Float | None
    mean_rel_error: Float | None
    rel_eps: Float | None = Field(description="eps of the relative error |x - r| / (|r| + eps)")
    dual_hundredth: Float | None = Field(description="share of relative errors below 0.01")
    dual_thousandth: Float | None = Field(description="share of relative errors below 0.001")
    dual_ten_thousandth: Float | None = Field(description="share of relative errors below 0.0001")
    rmse: Float | None
    error_balance: Float | None
    small_value_threshold: Float | None = Field(description="T: |r| <= T is a small value")
    small_value_count: StrictInt | None
    small_value_error_share: Float | None
    ulp_max: Float | None
    ulp_mean: Float | None
    ulp_bad_bound: Float | None
    ulp_bad_share: Float | None
    rel_l2: Float | None = Field(None, description="relative L2 error (absent in schema 1)")
    rel_l2_bound: Float | None = Field(
        None, description="the bound rule rel_l2 applies (absent in schema 1)"
    )
    small_value_atol: Float | None = Field(
        None, description="a small value with |x - r| above this is wrong (absent in schema 1)"
    )
    rel_l2_benchmark: Float | None = Field(
        None, description="rel_l2 of the benchmark path on the same example; null when none ran"
    )


class TensorResult(Part):
    """One compared tensor: its metrics and its verdict."""

    metrics: TensorMetrics
    verdict: Verdict


class Tolerance(Part):
    """A case's override of the default thresholds; null keeps a default."""

    reason: StrictStr = Field(description="why the case needs other thresholds (required)")
    cosine: Float | None = Field(description="cosine must be > this instead of 0.99")
    abs_pass: Float | None = Field(
        description="max abs error < this passes at once instead of 1e-3"
    )
    dual_error: Float | None = Field(
        description="N of the error-level dual check (0.01, 0.001 or 0.0001)"
    )
    dual_warning: Float | None = Field(
        description="N of the warning-level dual check (0.01, 0.001 or 0.0001)"
    )
    rel_l2: Float | None = Field(
        None,
        description="relative L2 error must be <= this instead of the computed bound "
        "(absent in schema 1)",
    )

    @model_validator(mode="after")
    def _rules(self) -> Self:
        check_tolerance(
            self.reason, self.cosine, self.abs_pass, self.dual_error, self.dual_warning, self.rel_l2
        )
        return self


class BenchmarkVerdict(Part):
    status: Literal["pass", "error"]
    reason: StrictStr


class BenchmarkTensor(Part):
    """msprobe's stage-2 outcome of one float tensor (its worst example)."""

    level: Literal[BENCHMARK_LEVELS] = Field(
        description="msprobe level (megatron_npu.parity.benchmark.LEVEL_LIMITS)"
    )
    tested: dict[str, Float] = Field(
        description="small_value_error_share, max_rel_error, mean_rel_error, rmse and "
        "error_balance of the tested path against the reference"
    )
    benchmark: dict[str, Float] = Field(description="the same of the benchmark path")
    ratios: dict[str, Float] = Field(
        description="|tested| / max(|benchmark|, floor): msprobe's calc_ratio"
    )
    limits: dict[str, Float] = Field(description="a ratio above its limit is an error")
    verdict: BenchmarkVerdict


class Benchmark(Part):
    """msprobe's stage-2 benchmark standard of a fp16/bf16 cell."""

    path: StrictStr = Field(description="what ran as the benchmark, in words")
    level: StrictStr = Field(
        description="msprobe level of the API the case serves: L1 attention, L2 norm, cross "
        "entropy, bias-GELU; L0 every other case"
    )
    tensors: dict[str, BenchmarkTensor] = Field(description="float tensor name -> its outcome")
    unavailable: StrictStr | None = Field(
        description="why the benchmark could not run; the tensors then keep their stage-1 verdicts"
    )


class Git(Part):
    commit: StrictStr | None = Field(description="short sha; null in a repository without commits")
    dirty: StrictBool = Field(description="tracked or untracked changes in the working tree")


class Provenance(Part):
    """Where and how the numbers were produced."""

    device: StrictStr = Field(description="the record's device label (validated equal)")
    device_name: StrictStr | None = Field(
        description="free-text hardware name, if the harness knows it"
    )
    python: StrictStr = Field(description="Python version")
    torch: StrictStr = Field(description="torch.__version__")
    torch_npu: StrictStr | None = Field(
        description="installed torch_npu version; null when not installed (the emulation never "
        "counts); a record of device npu needs it"
    )
    megatron_core: StrictStr | None = Field(description="installed megatron-core version")
    megatron_npu: StrictStr | None = Field(
        None, description="this package's version (absent in records written before it)"
    )
    hypothesis: StrictStr | None = Field(
        None,
        description="Hypothesis version: which examples the case drew depends on it (absent "
        "in records written before it)",
    )
    git: Git | None = Field(
        description="this package's own source checkout; null for an installed package and "
        "when git or the repository is unavailable"
    )
    seed: StrictInt | None = Field(description="seed of the case")
    hostname: StrictStr = Field(description="socket.gethostname()")
    timestamp_utc: StrictStr = Field(description="ISO 8601 UTC, YYYY-MM-DDTHH:MM:SS.ffffffZ")
    wall_time_s: Float = Field(description="wall time of the case in seconds")


class Parallel(Part):
    """The parallel sizes of the cell: exactly these keys."""

    model_config = ConfigDict(extra="forbid")

    tp: Size
    pp: Size
    dp: Size
    cp: Size = Field(description="context parallel (absent before schema 3: read as 1)")
    world: Size

    def label(self) -> str:
        """``tp1-pp1-dp1-cp1-world1``: the sizes as file names and report keys write them."""
        return "-".join(f"{k}{getattr(self, k)}" for k in PARALLEL_KEYS)


class ParityRecord(Document):
    """The result of one parity cell: a (patch, case, dtype, parallel sizes, device)
    combination, each compared tensor's metrics and verdict, and the overall verdict."""

    schema_name = "parity-record"
    non_finite = "strings"
    sort_keys = True

    schema_version: StrictInt = Field(
        description=f"{SCHEMA_VERSION} (written); readers accept {_READABLE}"
    )
    patch_id: Name = Field(description="id of the adaptor patch under test")
    target: Name = Field(description="dotted path of the Megatron function the patch replaces")
    case: Name = Field(description="parity case name")
    dtype: Literal[DTYPES] = Field(description="the dtype the patched path ran in; rules use it")
    parallel: Parallel
    device: Literal[DEVICES] = Field(
        description="npu only for a real Ascend NPU through torch_npu; an emulated run is "
        "npu-emulated"
    )
    tensors: dict[str, TensorResult] = Field(
        description="compared tensor name -> metrics and verdict; empty only in the record of a "
        f"failed cell (an error with rule {', '.join(NO_TENSOR_RULES)})"
    )
    verdict: Verdict = Field(description="overall: the worst tensor verdict")
    tolerance: Tolerance | None = Field(description="the override in effect, if any")
    provenance: Provenance
    kernels: dict[str, StrictInt] | None = Field(
        None,
        description="torch_npu kernel name -> calls made by the tested path on rank 0 (all "
        "examples); {} when none. Required from schema 2",
    )
    npu_kernel_exercised: StrictBool | None = Field(
        None,
        description="true exactly when kernels has a call: the cell reached an NPU kernel. "
        "Required from schema 2",
    )
    benchmark: Benchmark | None = Field(
        None,
        description="stage-2 benchmark of a fp16/bf16 cell; null for fp32 cells and cells with "
        "only exact outputs. Required (possibly null) from schema 2",
    )

    _source: str = PrivateAttr("<data>")

    @model_validator(mode="before")
    @classmethod
    def _cp_before_schema_3(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("schema_version") in READABLE_VERSIONS
            and data["schema_version"] < CP_SCHEMA
            and isinstance(data.get("parallel"), dict)
            and "cp" not in data["parallel"]
        ):
            return {**data, "parallel": {**data["parallel"], "cp": 1}}
        return data

    @field_validator("schema_version")
    @classmethod
    def _readable(cls, version: int) -> int:
        if version not in READABLE_VERSIONS:
            raise ValueError(f"is not a version the readers know ({_READABLE})")
        return version

    @model_validator(mode="after")
    def _rules(self) -> Self:
        if self.provenance.device != self.device:
            raise FieldError(
                "provenance.device",
                f"{self.provenance.device!r} is not the record's device {self.device!r}",
            )
        if self.device == NPU and self.provenance.torch_npu is None:
            raise FieldError(
                "provenance.torch_npu",
                f"device {NPU!r} needs the torch_npu version; emulated runs are {NPU_EMULATED!r}",
            )
        if not self.tensors:
            if self.verdict.status != "error" or self.verdict.rule not in NO_TENSOR_RULES:
                raise FieldError(
                    "tensors",
                    "a parity record needs at least one compared tensor, unless it is an error "
                    f"with rule {' / '.join(NO_TENSOR_RULES)}",
                )
        else:
            worst = max((t.verdict.status for t in self.tensors.values()), key=SEVERITY.get)
            if self.verdict.status != worst:
                raise FieldError(
                    "verdict.status",
                    f"overall verdict {self.verdict.status!r} is not the worst tensor verdict "
                    f"{worst!r}",
                )
        if self.schema_version >= 2:
            for name in ("kernels", "npu_kernel_exercised", "benchmark"):
                if name not in self.model_fields_set:
                    raise FieldError(name, "field required from schema 2")
            if self.kernels is None or self.npu_kernel_exercised is None:
                name = "kernels" if self.kernels is None else "npu_kernel_exercised"
                raise FieldError(name, "must not be null from schema 2")
            if self.npu_kernel_exercised != any(v > 0 for v in self.kernels.values()):
                raise FieldError("npu_kernel_exercised", "must say whether any kernel was called")
        return self

    @classmethod
    def parse(cls, data: Any, source: str = "<data>") -> Self:
        record = super().parse(data, source)
        record._source = source
        return record

    @property
    def source(self) -> str:
        """The file the record was read from (``<data>`` for one built in memory)."""
        return self._source

    @property
    def parallel_label(self) -> str:
        return self.parallel.label()

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """What identifies the cell: two records with the same key are the same cell."""
        return (self.patch_id, self.case, self.dtype, self.parallel_label, self.device)

    @property
    def label(self) -> str:
        return f"{self.patch_id} [{self.case}, {self.dtype}, {self.parallel_label}, {self.device}]"


DOCUMENTS = (ParityRecord,)
