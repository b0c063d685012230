"""``<out>/curves/<side>.json``: one side's loss curve from a ``megatron-npu locate`` curve run
(train's worker or a Megatron-LM script run through the adaptor), read back to find the first
divergent step. A NaN or infinite loss (a diverged step) is written ``"NaN"``/``"Infinity"``,
so it stays apart from null, a step without a loss."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator
from typing_extensions import Self

from megatron_npu.formats.base import Document, FieldError


class LocateCurve(Document):
    """Per-step loss and gradient norm, in step order (three lists of one length)."""

    schema_name: ClassVar[str] = "locate-curve"
    non_finite: ClassVar[str] = "strings"

    iterations: list[int] = Field(description="the steps, from 1")
    losses: list[float | None] = Field(
        description="each step's LM loss; null where the step had none"
    )
    grad_norms: list[float | None] = Field(description="each step's gradient norm; null where none")

    @classmethod
    def empty(cls) -> Self:
        """A curve to :meth:`add` steps to as they run."""
        return cls(iterations=[], losses=[], grad_norms=[])

    def add(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        self.iterations.append(step)
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    @model_validator(mode="after")
    def _one_length(self) -> Self:
        for name in ("losses", "grad_norms"):
            if len(getattr(self, name)) != len(self.iterations):
                raise FieldError(
                    name,
                    f"holds {len(getattr(self, name))} values for "
                    f"{len(self.iterations)} iterations",
                )
        return self


DOCUMENTS = (LocateCurve,)
