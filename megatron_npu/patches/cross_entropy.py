"""Megatron's vocab-parallel cross entropy -> the op layer's (fp32 maths, TP all-reduces)."""

from __future__ import annotations

from megatron_npu.ops.cross_entropy import vocab_parallel_cross_entropy as _op
from megatron_npu.registry import Patch


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token loss for this rank's vocab shard, reduced over the tensor-parallel group."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    local_vocab = vocab_parallel_logits.shape[-1]
    return _op(
        vocab_parallel_logits, target, vocab_start_index=rank * local_vocab,
        label_smoothing=label_smoothing,
        group=parallel_state.get_tensor_model_parallel_group() if world > 1 else None,
    )  # fmt: skip


PATCHES = [
    Patch(
        id="cross-entropy.vocab-parallel",
        target="megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy",
        replacement=vocab_parallel_cross_entropy,
        reason="seeds' _VocabParallelCrossEntropy forward/backward -> one fp32 op with TP reduces",
        versions=">=0.13",
        parity="parity.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY",
        benchmark="perf.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY",
    ),
]
