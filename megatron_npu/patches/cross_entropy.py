"""Megatron's vocab-parallel cross entropy -> the op layer's (fp32 maths, TP all-reduces)."""

from __future__ import annotations

from megatron_npu.ops.cross_entropy import vocab_parallel_cross_entropy as _op
from megatron_npu.registry import Patch


def _on_group(vocab_parallel_logits, target, label_smoothing, tp_group):
    import torch.distributed as dist
    from megatron.core import parallel_state

    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    local_vocab = vocab_parallel_logits.shape[-1]
    return _op(
        vocab_parallel_logits,
        target,
        vocab_start_index=rank * local_vocab,
        label_smoothing=label_smoothing,
        group=tp_group if world > 1 else None,
    )


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token loss for this rank's vocab shard, reduced over the tensor-parallel group."""
    return _on_group(vocab_parallel_logits, target, label_smoothing, None)


def vocab_parallel_cross_entropy_on_group(
    vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None
):
    """0.19's signature: the tensor-parallel group may be passed (``None``: Megatron's own)."""
    return _on_group(vocab_parallel_logits, target, label_smoothing, tp_group)


PATCHES = [
    Patch(
        id="cross-entropy.vocab-parallel",
        target="megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy",
        replacement=vocab_parallel_cross_entropy,
        reason=(
            "Megatron's _VocabParallelCrossEntropy forward/backward -> one fp32 op with TP reduces"
        ),
        versions=">=0.13,<0.19",
        parity="megatron_npu.parity.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY",
        benchmark="perf.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY",
    ),
    Patch(
        id="cross-entropy.vocab-parallel-tp-group",
        target="megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy",
        replacement=vocab_parallel_cross_entropy_on_group,
        reason="the same op, with 0.19's tp_group parameter",
        versions=">=0.19",
        parity="megatron_npu.parity.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY",
        benchmark="perf.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY",
    ),
]
