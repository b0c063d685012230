"""``<out>/locate-msprobe.json``: what ``megatron-npu locate --msprobe REF CAND`` found in two
msprobe dumps (the first row whose error its inputs do not explain), written by
:func:`megatron_npu.locate.command.locate_msprobe` and read by the report. The rule is
:mod:`megatron_npu.locate.msprobe_dumps`'s; docs/locate.md describes it. A non-finite error is
written ``"Infinity"`` or ``"NaN"``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from megatron_npu.formats.base import Document, Part
from megatron_npu.formats.locate_result import MsprobeMetrics

FORMAT = "megatron-npu-locate-msprobe"
SCHEMA_VERSION = 1
FILENAME = "locate-msprobe.json"


class Row(Part):
    """One msprobe row (a module's forward or backward call, or an API call) and its verdict."""

    rank: str = Field(description="the rank folder the row comes from (rank0, ...)")
    name: str = Field(description="msprobe's row name (Module.<name>.<Class>.forward.<call>...)")
    module: str = Field(description="the row's module: itself, or the module an API ran in")
    phase: str = Field(description="forward or backward")
    kind: str = Field(description="module or api")
    depth: int = Field(description="the row's depth in msprobe's module tree")
    output: float = Field(description="relative L2 error of the row's outputs")
    input: float = Field(description="relative L2 error of its inputs")
    tolerance: float = Field(description="the rule's limit for the outputs at that input error")
    diverges: bool = Field(description="output error beyond what the inputs explain")
    worst: str | None = Field(description="the output tensor with the largest error")


class DivergentRow(Row):
    """The first divergent row, with what a dump can say about the adaptor."""

    omit_when_none = frozenset({"msprobe_metrics", "module_patches"})

    msprobe_metrics: MsprobeMetrics | None = Field(
        None, description="msprobe's metrics of its worst tensor (task tensor only)"
    )
    patches: list[str] = Field(description="the adaptor patches the row reaches (by registry)")
    module_patches: list[str] | None = Field(
        None, description="an API row: the patches its module reaches"
    )


class LocateMsprobeResult(Document):
    """Two msprobe dumps compared row by row with the input-explained rule."""

    schema_name: ClassVar[str] = "locate-msprobe"
    non_finite: ClassVar[str] = "strings"

    format: Literal[FORMAT] = Field(description="always megatron-npu-locate-msprobe")
    schema_version: Literal[SCHEMA_VERSION]
    reference: str = Field(description="the reference dump's folder")
    candidate: str = Field(description="the candidate dump's folder")
    task: str = Field(description="msprobe's task of both dumps: tensor or statistics")
    levels: list[str] = Field(description="msprobe's dump levels found (L0, mix, ...)")
    ranks: list[str] = Field(description="the rank folders compared")
    statement: str | None = Field(
        description="what a statistics-only comparison can and cannot show; null for tensors"
    )
    divergent: DivergentRow | None = Field(description="the first divergent row, or null")
    rows: list[Row] = Field(description="every compared row, in dump order")
    unmatched: dict[str, Any] = Field(
        default_factory=dict, description="rows only one side has, by side"
    )


DOCUMENTS = (LocateMsprobeResult,)
