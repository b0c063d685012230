"""Megatron's vocab-parallel cross entropy -> the op layer's (fp32 maths, TP all-reduces).

``--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`` calls Transformer Engine's
``parallel_cross_entropy`` through ``language_module.te_parallel_cross_entropy``, which Megatron
binds to None without TE (and then raises "Trying to use a TE block when it's not present"). TE's
contract is the same loss with no smoothing and no reduction, in fp32, where a label of -100 (its
``ignore_idx``) loses nothing and passes no gradient; the op layer serves it so.
"""

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


#: TE's ``parallel_cross_entropy`` ignore index, as Megatron's wrapper passes it
TE_IGNORE_INDEX = -100


def te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable=False):
    """Transformer Engine's vocab-parallel cross entropy as Megatron calls it: per-token fp32
    loss shaped like ``labels``, 0 (and no gradient) where a label is -100."""
    ignored = labels == TE_IGNORE_INDEX
    loss = _on_group(logits, labels.masked_fill(ignored, 0), 0.0, tp_group)
    return loss.masked_fill(ignored, 0.0)


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
    Patch(
        id="cross-entropy.te-parallel",
        target="megatron.core.models.common.language_module.language_module."
        "te_parallel_cross_entropy",
        replacement=te_parallel_cross_entropy,
        reason="--cross-entropy-fusion-impl te: Transformer Engine's parallel_cross_entropy "
        "(bound to None without TE) -> the same fp32 op with TE's ignore index",
        versions=">=0.13",
        check_signature=False,  # the target is None where TE is missing
        rebind_copies=False,
        parity="megatron_npu.parity.cases.cross_entropy:TE_PARALLEL_CROSS_ENTROPY",
        benchmark_exempt="the op is cross-entropy.vocab-parallel's "
        "(perf.cases.cross_entropy:VOCAB_PARALLEL_CROSS_ENTROPY); the ignore mask adds two "
        "elementwise fills",
    ),
]
