"""``<dump>/rank<R>/index.json``: one rank's part of a ``megatron-npu locate`` dump, written by
:class:`megatron_npu.locate.dump.Recorder` and read by every comparison of two dumps.

Each rank folder is an msprobe dump (``dump.json``, msprobe's own format, read as msprobe writes
it); the index sits beside it and is what locate itself reads: every recorded tensor with its
file in ``dump_tensor_data/``, and the rank's module table (kind, depth, the adaptor patches each
module reached). The dump folder's layout is in docs/locate.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from megatron_npu.formats.base import Document, Part


class Coords(Part):
    """The rank's place in the parallel layout (Megatron-Core's ``parallel_state``)."""

    omit_when_none = frozenset({"cp"})

    tp: int = Field(description="tensor-parallel rank")
    pp: int = Field(description="pipeline-parallel rank")
    dp: int = Field(description="data-parallel rank")
    cp: int | None = Field(
        None, description="context-parallel rank; only under context parallelism"
    )


class TensorStats(Part):
    """Statistics of the whole tensor (a sampled tensor's file holds only its sample)."""

    numel: int = Field(description="elements of the whole tensor")
    nonfinite: int | None = Field(None, description="its NaN and infinite elements")
    mean: float | None = Field(None, description="over the finite elements; null when none")
    std: float | None = Field(None, description="over the finite elements; null below two")
    min: float | None = Field(None, description="over the finite elements; null when none")
    max: float | None = Field(None, description="over the finite elements; null when none")
    l2: float | None = Field(
        None,
        description="L2 norm of the finite elements (of a parameter update: of the update, "
        "the only statistic it has); null when none",
    )


class Entry(Part):
    """One recorded tensor."""

    omit_when_none = frozenset({"param_owner"})

    key: str = Field(description="<module>#<call>|<quantity>|<index>: the same in both runs")
    module: str = Field(
        description="the module's dotted name (the root is model; parameter updates are under "
        "the pseudo-module optimizer)"
    )
    call: int = Field(description="which call of the module, from 0")
    quantity: str = Field(
        description="forward.input, forward.output, backward.grad_output (the gradient reaching "
        "the module's outputs), backward.grad_input (the one it sends to its inputs), "
        "param.grad:<name> (a parameter's gradient) or param.update:<parameter> (its change by "
        "the optimizer step)"
    )
    index: int = Field(description="which tensor of the quantity, from 0")
    order: int = Field(description="when it was recorded, from 0 (the rank's order)")
    shape: list[int] = Field(description="the whole tensor's shape")
    dtype: str = Field(description="torch dtype without the torch. prefix (float32, bfloat16)")
    sampled: bool = Field(
        description="the file holds a sample of `limit` elements at flat indices drawn by a "
        "generator seeded with the element count (sorted): the same positions in both runs"
    )
    stats: TensorStats
    param_owner: str | None = Field(
        None, description="param.update entries: the module that owns the parameter"
    )
    data_name: str = Field(
        description="the tensor's file in dump_tensor_data/ (torch.save; msprobe's Data_name for "
        "the rows msprobe has)"
    )


class Patches(Part):
    """The adaptor patches a module reached during the step (sorted patch ids)."""

    own: list[str] = Field(
        default_factory=list,
        description="patches whose code ran while it was the innermost module, or that built it",
    )
    total: list[str] = Field(
        default_factory=list, description="those and every patch its sub-modules reached"
    )


class ModuleInfo(Part):
    """One module of the rank's model (and the pseudo-module optimizer)."""

    # the file's key is "class"; Python code names it class_name
    model_config = ConfigDict(
        validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    kind: str = Field(
        description="embedding, norm, attention, softmax, rotary, moe, mlp, linear, layer, block, "
        "output, loss (the root), optimizer or other"
    )
    class_name: str = Field(alias="class", description="the module's class name")
    depth: int = Field(
        description="0 the embedding, N + 1 inside layer N, layers + 1 after them (the "
        "optimizer: layers + 2); the tolerance grows with it"
    )
    patches: Patches = Field(
        default_factory=Patches, description="{} when the patches were not traced"
    )


class DumpIndex(Document):
    """One rank of a locate dump: every recorded tensor of the step and the module table."""

    schema_name = "locate-dump-index"
    # an index holds an entry per tensor: one space per level keeps it small
    indent: ClassVar[int] = 1
    # a parameter update that became NaN stays visible ("NaN"); null means no finite element
    non_finite: ClassVar[str] = "strings"

    rank: int = Field(description="the global rank")
    coords: Coords
    limit: int = Field(description="elements kept per tensor; a larger one is sampled")
    entries: list[Entry] = Field(description="every recorded tensor, in the order recorded")
    modules: dict[str, ModuleInfo] = Field(description="the rank's modules by dotted name")


#: ``format`` of ``<dump>/locate-dump.json``
DUMP_FORMAT = "megatron-npu-locate-dump"
#: its ``version``: 2 (the rank folders hold msprobe's dump.json beside their index)
DUMP_VERSION = 2


class DumpMeta(Document):
    """``<dump>/locate-dump.json``: what one replayed step of a ``megatron-npu locate`` dump ran
    (written by the rank that holds the loss; read before any rank folder)."""

    schema_name: ClassVar[str] = "locate-dump"
    indent: ClassVar[int] = 1
    non_finite: ClassVar[str] = "strings"  # a diverged step's loss, as the index writes it

    format: Literal[DUMP_FORMAT] = Field(description="always megatron-npu-locate-dump")
    version: Literal[DUMP_VERSION] = Field(description="the dump layout's version")
    step: int = Field(description="the replayed training step")
    world: int = Field(1, description="ranks of the replay: one rank folder each")
    device: str | None = Field(None, description="the device the replay ran on")
    dtype: str = Field("float32", description="the model's parameter dtype (float32, bfloat16...)")
    argv: list[str] = Field(
        default_factory=list, description="the run's options (train's, or the script's)"
    )
    script: str | None = Field(None, description="a Megatron-LM script replay: the script")
    disabled: list[str] = Field(
        default_factory=list, description="adaptor patches switched off for the replay"
    )
    plant: str | None = Field(None, description="the bug planted for the replay, if any")
    loss: float | None = Field(None, description="the step's LM loss")
    grad_norm: float | None = Field(None, description="the step's gradient norm")
    npu_kernels: bool = Field(False, description="torch_npu's kernels (or their emulation) ran")
    native_kernels: list[str] = Field(
        default_factory=list, description="the kernels served by the native torch path"
    )
    applied: list[str] = Field(
        default_factory=list, description="the adaptor patches applied in the replay"
    )


DOCUMENTS = (DumpIndex, DumpMeta)
