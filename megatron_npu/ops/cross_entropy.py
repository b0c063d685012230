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
**Deliberate difference from Megatron**: Megatron's ``_VocabParallelCrossEntropy`` uses each
rank's shard size and the mean over the shard, so with TP > 1 every rank computes another loss
and a TP2 run does not train the TP1 objective. Here every rank gets the TP1 loss (one extra
all-reduce of one number per token), which keeps TP layouts equivalent; without smoothing, and at
TP1, the two are the same (``tests/ops/test_cross_entropy.py`` runs Megatron's own function at
TP2 beside this one).

Memory and time: fp32 logits that are an activation (not a leaf) are worked on in place, as
Megatron's kernel does: the forward turns them into the softmax in their own storage (one exp
pass) and the backward into the gradient -- no temporary as large as the logits. Other logits
(16-bit, or a leaf whose values the caller keeps) are read in row chunks of at most
:data:`CHUNK_BYTES` of fp32: the forward keeps only per-row statistics and the backward
recomputes the softmax per chunk, so the peak extra memory is one chunk plus the gradient in the
logits' dtype (for 16-bit logits half of Megatron's fp32 copy).
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


#: fp32 working set of one row chunk; the op never holds more than this beyond its input/output.
CHUNK_BYTES = 32 * 2**20


def _fp32_chunks(rows: torch.Tensor):
    """``(row slice, fp32 copy of those rows)`` per chunk, all in one reused buffer (a fresh
    allocation per chunk would page-fault its memory in every time)."""
    count, vocab = rows.shape
    step = max(1, min(count, CHUNK_BYTES // (4 * max(vocab, 1))))
    buffer = torch.empty(step, vocab, dtype=torch.float32, device=rows.device)
    for start in range(0, count, step):
        chunk = slice(start, min(count, start + step))
        work = buffer[: chunk.stop - start]
        work.copy_(rows[chunk])
        yield chunk, work


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """No [tokens, V] fp32 temporary: in place for fp32 activations, else chunked over rows
    (module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, label_smoothing, reduce_max, reduce_sum):
        local_vocab = logits.shape[-1]
        rows = logits.reshape(-1, local_vocab)
        flat_target = target.reshape(-1)
        row_max = reduce_max(rows.amax(dim=-1).float())
        outside = (flat_target < vocab_start) | (flat_target >= vocab_start + local_vocab)
        local_target = (flat_target - vocab_start).masked_fill(outside, 0)
        picked = rows.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - row_max
        picked = reduce_sum(picked.masked_fill(outside, 0.0))

        smoothing = label_smoothing > 0.0
        # fp32 activation logits become the softmax in their own storage, as in Megatron's
        # kernel (one exp pass, no temporary); anything else is read chunk by chunk
        in_place = logits.dtype == torch.float32 and not logits.is_leaf and logits.is_contiguous()
        sum_exp = torch.empty_like(row_max)
        sum_shifted = torch.empty_like(row_max) if smoothing else None
        chunks = ((slice(None), rows),) if in_place else _fp32_chunks(rows)
        for chunk, shifted in chunks:
            shifted.sub_(row_max[chunk].unsqueeze(-1))
            if smoothing:
                sum_shifted[chunk] = shifted.sum(dim=-1)
            sum_exp[chunk] = shifted.exp_().sum(dim=-1)
        sum_exp = reduce_sum(sum_exp)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - picked

        coeff, vocab = 0.0, local_vocab
        if smoothing:
            vocab = int(reduce_sum(torch.tensor(float(local_vocab), device=logits.device)).item())
            if vocab < 2:
                raise ValueError(
                    "vocab_parallel_cross_entropy: label smoothing needs a vocab of at least 2"
                )
            coeff = label_smoothing * vocab / (vocab - 1)
            # sum over the local shard of log p = sum(shifted) - V_local * log_sum_exp
            sum_log_probs = reduce_sum(sum_shifted - local_vocab * log_sum_exp)
            loss = (1.0 - coeff) * loss - coeff * sum_log_probs / vocab

        ctx.smoothing, ctx.vocab, ctx.in_place = coeff, vocab, in_place
        if in_place:
            rows.div_(sum_exp.unsqueeze(-1))  # the logits' storage now holds the softmax
            ctx.save_for_backward(logits, outside, local_target)
        else:
            ctx.save_for_backward(logits, row_max + log_sum_exp, outside, local_target)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        upstream = grad_loss.reshape(-1).float()
        if ctx.in_place:
            softmax, outside, local_target = ctx.saved_tensors
            rows = softmax.view(-1, softmax.shape[-1])
            _softmax_to_grad(rows, local_target, outside, upstream, ctx.smoothing, ctx.vocab)
            return softmax, None, None, None, None, None
        logits, log_norm, outside, local_target = ctx.saved_tensors
        rows = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(rows)
        for chunk, softmax in _fp32_chunks(rows):
            softmax.sub_(log_norm[chunk].unsqueeze(-1)).exp_()
            _softmax_to_grad(
                softmax,
                local_target[chunk],
                outside[chunk],
                upstream[chunk],
                ctx.smoothing,
                ctx.vocab,
            )
            grad[chunk] = softmax
        return grad.view(logits.shape), None, None, None, None, None


def _softmax_to_grad(softmax, local_target, outside, upstream, smoothing: float, vocab: int):
    """``softmax`` rows -> the loss gradient of those rows, in place."""
    hit = (~outside).float().mul_(1.0 - smoothing)
    softmax.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
    if smoothing > 0.0:
        softmax.sub_(smoothing / vocab)
    softmax.mul_(upstream.unsqueeze(-1))


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
