"""``megatron_npu_checkpoint.json``: the manifest a ``megatron-npu train`` save writes last into
each checkpoint iteration directory (``SAVE/iter_0000005/``).

The launcher reads it before any rank starts (``training/preflight.py``): the model fingerprint
(a checkpoint of another model is refused naming the field and its flag), the LR/WD schedule and
optimizer kind of a save with optimizer state, and every file's size and SHA-256 (a truncated,
emptied or altered file is refused naming the file). ``training/checkpoint_store.py`` writes it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, NonNegativeInt

from megatron_npu.formats.base import Document, Part

#: the ``schema`` field's value, which tells a manifest from any other JSON file
SCHEMA = "megatron-npu/checkpoint"


class SavedFile(Part):
    """One file of the checkpoint as the save wrote it."""

    bytes: NonNegativeInt = Field(description="its size")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="its SHA-256, hex")


class SavedArguments(Part):
    """The options of the run that saved, as the load checks need them."""

    train_iters: int | None = Field(None, description="--train-iters")
    global_batch_size: int | None = Field(None, description="--global-batch-size")
    use_distributed_optimizer: bool | None = Field(
        None, description="--use-distributed-optimizer (its optimizer state is laid out so)"
    )


class CheckpointManifest(Document):
    """What a save wrote, and of which model and schedule."""

    schema_name: ClassVar[str] = "checkpoint-manifest"
    indent: ClassVar[int] = 1
    # the file's key is "schema", which pydantic's BaseModel holds as a method name
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    schema_: Literal["megatron-npu/checkpoint"] = Field(
        alias="schema", description=f"always {SCHEMA!r}"
    )
    version: Literal[1] = Field(1, description="the manifest's version")
    iteration: NonNegativeInt = Field(description="the iteration the checkpoint holds")
    fingerprint: dict[str, Any] = Field(
        default_factory=dict,
        description="what decides the weight shapes and what the token ids mean (layers, "
        "widths, heads, vocabulary, spec, experts: checkpoint_store.FINGERPRINT_FLAGS)",
    )
    scheduler: dict[str, Any] | None = Field(
        None,
        description="the LR/WD scheduler's settings (schedule.FIELD_FLAGS); null for a save "
        "without optimizer state",
    )
    arguments: SavedArguments = Field(default_factory=SavedArguments)
    layout: dict[str, Any] = Field(
        default_factory=dict, description="the parallel layout that saved (TP, PP, EP, ...)"
    )
    files: dict[str, SavedFile] = Field(
        default_factory=dict, description="every file of the iteration directory but this one"
    )


DOCUMENTS = (CheckpointManifest,)
