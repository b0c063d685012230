"""``--results-out`` of ``megatron-npu evaluate --task lambada`` (``<run>/lambada.json`` under
compare): the zero-shot cloze accuracy of one checkpoint, written by
:mod:`megatron_npu.evaluate.command` and read by compare (Table 2's cloze columns, ``run.json``
and ``results.json`` carry it)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from megatron_npu.formats.base import Document


class LambadaResult(Document):
    """Megatron-LM's ``tasks/zeroshot_gpt`` LAMBADA figures, and which checkpoint they are of."""

    schema_name: ClassVar[str] = "lambada-result"

    task: str = Field(description="lambada")
    set: str | None = Field(
        None, description="lambada (a lambada_test.jsonl-format file) or corpus-cloze (default)"
    )
    accuracy: float = Field(description="correct / n")
    correct: int = Field(description="passages whose last word was predicted exactly")
    n: int = Field(description="passages evaluated")
    strict: bool = Field(description="--strict-lambada: the whole last word must match")
    target_nll: float | None = Field(
        None, description="mean negative log-likelihood of the target tokens"
    )
    truncated: int | None = Field(None, description="passages cut to the sequence length")
    data: str | None = Field(None, description="--valid-data as given")
    load: str | None = Field(None, description="the checkpoint directory loaded")
    iteration: int | None = Field(None, description="the checkpoint's iteration")
    layout: Any = Field(None, description="the layout the checkpoint was saved in")


DOCUMENTS = (LambadaResult,)
