"""Vocab-parallel cross entropy on one rank's vocab shard.

Each rank holds ``logits[..., V_local]`` for the global vocab ids
``[vocab_start_index, vocab_start_index + V_local)``. The loss needs three all-reduces over the
tensor-parallel ranks (max of the row maxima, sum of the target logit, sum of the exponentials),
and a fourth (sum of the log-probabilities) only with label smoothing. They are given as:

* ``all_reduce_max`` / ``all_reduce_sum`` callables: called as ``fn(tensor)`` and returning the
  reduced tensor (they may reduce in place and return their argument), or
* ``group``: a ``torch.distributed`` process group, reduced with ``all_reduce`` on it, or
* neither: a single rank (TP=1), no communication and no process group needed.

The default process group is never used implicitly (that would silently reduce over data
parallel ranks). Maths in fp32 (like Megatron); returns the per-token loss in fp32 and the
logits' gradient in the logits' dtype. There is no torch_npu kernel involved: the same code runs
on every device (on an NPU the collectives run over HCCL).

Label smoothing follows Megatron's formula with the *global* vocab size
``K = sum(V_local)``: ``loss = (1 - s) * nll - s * mean(log_probs)``, ``s = alpha*K/(K-1)``.
(Megatron itself uses the local shard size and the local mean there, which differs for TP>1.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_npu.ops._common import check_float_dtype

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _dist_reduce(op, group) -> Reduce:
    def fn(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=op, group=group)
        return t

    return fn


def _reducers(all_reduce_max, all_reduce_sum, group) -> tuple[Reduce, Reduce]:
    if (all_reduce_max is None) != (all_reduce_sum is None):
        raise ValueError(
            "vocab_parallel_cross_entropy: pass both all_reduce_max and all_reduce_sum, or neither"
        )
    if all_reduce_max is not None:
        if group is not None:
            raise ValueError(
                "vocab_parallel_cross_entropy: pass either reduce callables or group, not both"
            )
        return all_reduce_max, all_reduce_sum
    if group is not None:
        return _dist_reduce(dist.ReduceOp.MAX, group), _dist_reduce(dist.ReduceOp.SUM, group)
    return _identity, _identity


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, label_smoothing, reduce_max, reduce_sum):
        local_vocab = logits.shape[-1]
        x = logits.float()
        row_max = reduce_max(x.amax(dim=-1))
        shifted = x - row_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = reduce_sum(picked.masked_fill(outside, 0.0))

        exp = shifted.exp()
        sum_exp = reduce_sum(exp.sum(dim=-1))
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - picked
        softmax = exp.div_(sum_exp.unsqueeze(-1))

        smoothing, vocab = 0.0, local_vocab
        if label_smoothing > 0.0:
            vocab = int(reduce_sum(torch.tensor(float(local_vocab), device=x.device)).item())
            if vocab < 2:
                raise ValueError(
                    "vocab_parallel_cross_entropy: label smoothing needs a vocab of at least 2"
                )
            smoothing = label_smoothing * vocab / (vocab - 1)
            # sum over the local shard of log p = sum(shifted) - V_local * log_sum_exp
            sum_log_probs = reduce_sum(shifted.sum(dim=-1) - local_vocab * log_sum_exp)
            loss = (1.0 - smoothing) * loss - smoothing * sum_log_probs / vocab

        ctx.smoothing, ctx.vocab = smoothing, vocab
        ctx.logits_dtype = logits.dtype
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).float() * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing > 0.0:
            grad.sub_(ctx.smoothing / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start_index: int = 0,
    label_smoothing: float = 0.0,
    all_reduce_max: Reduce | None = None,
    all_reduce_sum: Reduce | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token loss (fp32, shaped like ``target``) for this rank's vocab shard."""
    op = "vocab_parallel_cross_entropy"
    check_float_dtype(op, "logits", logits)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: target must be an int64/int32 tensor, got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{op}: target shape {tuple(target.shape)} must equal logits shape without the "
            f"vocab dim {tuple(logits.shape[:-1])}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_start_index < 0:
        raise ValueError(f"{op}: vocab_start_index must be >= 0, got {vocab_start_index}")
    reduce_max, reduce_sum = _reducers(all_reduce_max, all_reduce_sum, group)
    return _VocabParallelCrossEntropy.apply(
        logits, target.long(), vocab_start_index, label_smoothing, reduce_max, reduce_sum
    )
