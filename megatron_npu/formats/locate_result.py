"""``<out>/locate.json``: what ``megatron-npu locate`` found (the step, the module and the patch
where two runs part), written by :func:`megatron_npu.locate.command.locate` and read by the
report (``megatron-npu report``). The method behind each field is in docs/locate.md.

Relative errors are ``rel_l2`` of :func:`megatron_npu.parity.metrics.compare`; a non-finite one
is written ``"Infinity"`` or ``"NaN"``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from megatron_npu.formats.base import Document, Part
from megatron_npu.formats.locate_dump import Patches

FORMAT = "megatron-npu-locate"
SCHEMA_VERSION = 1
FILENAME = "locate.json"


class RunSide(Part):
    """One of the two runs."""

    label: str = Field(description="reference or candidate (a compare run: its name)")
    device: str = Field(description="the device it ran on (auto when the options name none)")
    argv: list[str] = Field(
        description="its megatron-npu train options (--device included, --nproc-per-node not); "
        "with script: the script's own arguments"
    )
    world: int = Field(1, description="ranks of the run (--nproc-per-node)")
    disable: list[str] = Field(
        default_factory=list, description="patches the run itself switched off (--disable-patch)"
    )
    script: str | None = Field(
        None, description="the user's Megatron-LM script both runs are; absent for train runs"
    )
    plant: str | None = Field(
        None, description="a parity mutation planted in the run (a test aid); else absent"
    )


class Approximate(Part):
    """The approximate rule's verdict on the two curves, by its defaults."""

    status: str = Field(description="pass, fail, or not-run (--step named the step)")
    detail: str | None = Field(None, description="the rule's findings in words")
    tolerance: dict[str, int | float] | None = Field(
        None, description="the rule's limits (rtol, mean_rtol, late_window, ...)"
    )


class StepFinding(Part):
    """The first divergent step, from the loss and grad-norm curves."""

    step: int | None = Field(
        description="the first divergent step; null when the curves agree or --step named it"
    )
    quantity: Literal["loss", "grad_norm"] | None = Field(
        description="which curve left the threshold first"
    )
    rel_error: float | None = Field(description="that curve's relative error at the step")
    threshold: float | None = Field(
        description="the search stage it was beyond: 0.05, 0.02, then 1e-4"
    )
    approximate: Approximate


class Dumps(Part):
    """The dump folders compared."""

    reference: str = Field(description="the reference's dump (made here, or --reference-dump)")
    candidate: str | None = Field(description="the candidate's; null with --dump-only")


class Rule(Part):
    """The input-explained rule: tolerance(depth) = base * (1 + growth * depth); a module
    diverges when its error exceeds the tolerance and gain * its inputs' error + tolerance."""

    base: float = Field(description="rel_l2 tolerance at depth 0 (by the candidate's dtype)")
    growth: float = Field(description="per-layer growth of the tolerance")
    gain: float = Field(description="how much a module may amplify its inputs' error")


class PhaseError(Part):
    """A module's error in one phase."""

    output: float | None = Field(
        description="the largest error of what it produced (null: nothing recorded)"
    )
    input: float = Field(description="the largest error of what it was given")
    ratio: float | None = Field(description="output / input")
    tolerance: float = Field(description="the rule's tolerance at the module's depth")
    diverges: bool = Field(description="the output error is beyond what its inputs explain")
    worst: str | None = Field(description="the dump key of the tensor with the largest error")


class ModuleRow(Part):
    """One module (and shard) of the replayed step."""

    omit_when_none = frozenset({"forward", "backward", "update"})

    name: str = Field(description="the module, with @<shard> when the world has several ranks")
    module: str = Field(description="its dotted name (model: the loss; optimizer: the updates)")
    rank: int
    shard: str = Field(description="tp<T>.pp<P>.dp<D>[.cp<C>], empty on one rank")
    kind: str = Field(
        description="embedding, norm, attention, softmax, rotary, moe (a router, the experts, "
        "one local expert, an expert linear, a shared expert), mlp, linear, layer, block, "
        "output, loss, optimizer or other"
    )
    depth: int = Field(description="0 embedding, N + 1 in layer N, layers + 1 after them")
    patches: Patches = Field(description="the adaptor patches it reached")
    forward: PhaseError | None = Field(
        None, description="its outputs against its inputs (absent: not recorded)"
    )
    backward: PhaseError | None = Field(
        None,
        description="the gradients it sends to its inputs and its parameters' gradients, "
        "against the gradients reaching its outputs",
    )
    update: PhaseError | None = Field(
        None, description="its parameters' change by the optimizer step, against their gradients"
    )


class MsprobeMetrics(Part):
    """What ``msprobe compare`` shows for a divergent module's or row's worst tensor (here and
    in ``locate-msprobe.json``)."""

    omit_when_none = frozenset({"data_name"})

    data_name: str | None = Field(
        None,
        description="the tensor's file (the Data_name column of msprobe's table); locate.json "
        "names it, locate-msprobe.json does not",
    )
    cosine: float | None = Field(description="cosine similarity with the reference's tensor")
    max_abs_error: float | None = Field(description="largest absolute difference")
    max_rel_error: float | None = Field(description="largest relative difference")
    passes_msprobe_thresholds: bool = Field(
        description="cosine > 0.99 and max abs error < 0.001 (as for locate --msprobe)"
    )


class Divergent(Part):
    """The first divergent module: forward phase first (in the order the modules finished), then
    backward, then the updates."""

    omit_when_none = frozenset({"msprobe"})

    module: str = Field(description="its dotted name")
    name: str = Field(description="its row's name (with @<shard> on several ranks)")
    shard: str
    rank: int
    kind: str = Field(description="the module's kind; optimizer for an update divergence")
    module_kind: str = Field(description="the module's own kind")
    phase: Literal["forward", "backward", "update"] = Field(description="the divergent phase")
    output: float | None = Field(description="from here to worst: its row's phase")
    input: float
    ratio: float | None
    tolerance: float
    diverges: bool
    worst: str | None
    msprobe: MsprobeMetrics | None = Field(
        None, description="msprobe compare's metrics of its worst tensor; absent when unmeasured"
    )


class GradientCheck(Part):
    """One parameter gradient against TTrace's bound."""

    parameter: str
    layer: int
    error: float = Field(description="relative gradient error ||g - g_ref|| / ||g_ref||")
    bound: float = Field(description="k * C**(L + 1 - layer) * eps")
    exceeds: bool


class GradientBound(Part):
    """TTrace's gradient bound on the replayed step (Megatron-LM's checkpoint-consistency test),
    beside the rule's verdict."""

    rule: str = Field(description="the bound in words")
    num_layers: int
    dtype: str = Field(description="the candidate's dtype (eps)")
    parameters: int = Field(description="parameter gradients checked")
    caught: bool = Field(description="some gradient is beyond its bound")
    exceeding: list[GradientCheck] = Field(description="the gradients beyond their bound")
    worst: GradientCheck | None = Field(description="the largest error / bound")


class Trial(Part):
    """One replay of the candidate's step with some patches switched off."""

    disabled: list[str] = Field(
        description="patch ids switched off, and kernel:NAME items (kernels served natively, "
        "their patches installed)"
    )
    fixed: bool | None = Field(
        description="the module came back within tolerance; null: the replay failed"
    )
    detail: str = ""


class Culprit(Part):
    """The delta-debugging search over the patches the module reaches."""

    culprits: list[str] = Field(
        description="patch ids whose switching-off fixes the module (empty: not found)"
    )
    kernels: list[str] = Field(
        default_factory=list,
        description="torch_npu kernels whose native service fixed the module (the culprits "
        "call them)",
    )
    suspects: list[str] = Field(
        default_factory=list,
        description="nothing fixed: the narrowest set whose switching-off could not be replayed",
    )
    candidate_sets: list[list[str]] = Field(description="the sets searched, in order")
    trials: list[Trial]
    note: str = ""


class Timing(Part):
    """Seconds per part of the search (a part that did not run is absent)."""

    omit_when_none = frozenset(
        {"curves_s", "dump_reference_s", "dump_candidate_s", "compare_s", "culprit_s", "total_s"}
    )

    curves_s: float | None = None
    dump_reference_s: float | None = None
    dump_candidate_s: float | None = None
    compare_s: float | None = None
    culprit_s: float | None = None
    total_s: float | None = None


class LocateResult(Document):
    """Where two training runs part: the first divergent step, the first module whose error its
    inputs do not explain, and the adaptor patch whose removal brings it back."""

    schema_name = "locate"
    non_finite: ClassVar[str] = "strings"

    format: Literal["megatron-npu-locate"]
    schema_version: Literal[1]
    reference: RunSide = Field(description="the reference run")
    candidate: RunSide = Field(description="the candidate run")
    step: StepFinding = Field(description="the first divergent step")
    replayed_step: int | None = Field(
        None, description="the step the modules were compared on (step 1 when the curves agree)"
    )
    dumps: Dumps | None = Field(None, description="the two dump folders")
    modules: list[ModuleRow] = Field(
        description="one row per module and shard, rank by rank; empty with --dump-only"
    )
    divergent: Divergent | None = Field(description="the first divergent module; null: none")
    culprit: Culprit | None = Field(
        description="the patch search; null when nothing diverged, or with --no-culprit"
    )
    rule: Rule | None = Field(None, description="the rule the modules were held to")
    gradient_bound: GradientBound | None = Field(
        None, description="TTrace's gradient bound on the replayed step, beside the rule"
    )
    timing: Timing | None = Field(None, description="seconds per part")
    reproduce: str = Field(description="the command that repeats the search from the step")

    @classmethod
    def of(cls, found: dict[str, Any], source: str = FILENAME) -> LocateResult:
        """The result of a search: ``found`` (its fields) under this format and version."""
        return cls.parse({"format": FORMAT, "schema_version": SCHEMA_VERSION, **found}, source)


def is_locate(data: Any) -> bool:
    """Whether decoded JSON says it is a locate result (of any schema version)."""
    return isinstance(data, dict) and data.get("format") == FORMAT


DOCUMENTS = (LocateResult,)
