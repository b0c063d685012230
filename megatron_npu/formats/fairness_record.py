"""``fairness.json`` of the GPU check (``perf/gpu_check.py``'s ``fairness`` part): the s/step of
the check's GPT-345M ``--use-flash-attn`` row under ``megatron-npu train`` against the same
model trained by a plain PyTorch loop on the same device (``perf/plain_gpt.py``: the same
batch, micro-batches and dropout), and whether their ratio meets the target. Written by the
check, read by its tests and by whoever holds the competitor folder it is committed to."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator
from typing_extensions import Self

from megatron_npu.formats.base import Document, FieldError, Part


class TwinShape(Part):
    """The model both trainers ran (the plain twin's ``GPTShape``)."""

    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    seq_length: PositiveInt
    vocab_size: PositiveInt = Field(description="padded, as Megatron pads it")
    micro_batch_size: PositiveInt
    attention_dropout: NonNegativeFloat
    hidden_dropout: NonNegativeFloat


class FairnessRecord(Document):
    """One measurement of the row against its twin on one device."""

    schema_name: ClassVar[str] = "fairness"

    megatron_npu_s_per_step: PositiveFloat = Field(
        description="the row's median s/step under megatron-npu train (compare's statistic, "
        "after the matrix's warm-up steps)"
    )
    megatron_npu_ci95: tuple[NonNegativeFloat, NonNegativeFloat] = Field(
        description="95 % interval of that median, seconds"
    )
    megatron_npu_source: str = Field(
        description="where that figure comes from: 'compare' (the compare part's run of the "
        "row) or a run of the row alone"
    )
    plain_torch_eager_s_per_step: PositiveFloat = Field(
        description="the twin's median s/step (10 steps after 3, device synchronised around each)"
    )
    ratio: PositiveFloat = Field(
        description="megatron_npu_s_per_step / plain_torch_eager_s_per_step"
    )
    target: PositiveFloat = Field(description="the largest ratio that is fair")
    device: str = Field(description="the device both ran on")
    shape: TwinShape
    micro_batches: PositiveInt = Field(description="micro-batches per step")
    dtype: str = Field(description="the parameters' dtype, as torch names it")

    @model_validator(mode="after")
    def _ratio_is_of_the_figures(self) -> Self:
        expected = self.megatron_npu_s_per_step / self.plain_torch_eager_s_per_step
        if abs(self.ratio - expected) > 1e-9 * expected:
            raise FieldError(
                "ratio", f"{self.ratio} is not megatron_npu_s_per_step / its twin's ({expected})"
            )
        return self

    @property
    def fair(self) -> bool:
        """The ratio is within the target."""
        return self.ratio <= self.target


DOCUMENTS = (FairnessRecord,)
