"""Vocab-parallel cross entropy: TP=1 without a process group, TP>1 on threads with reduce
callables, and a real (single-rank gloo) process group, against plain fp64."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_npu.ops.cross_entropy import vocab_parallel_cross_entropy

from ._accuracy import assert_accurate
from ._paths import native_kernels_around_each_test  # noqa: F401

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def reference(logits, target, smoothing):
    x = logits.double()
    log_probs = x - torch.logsumexp(x, dim=-1, keepdim=True)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if smoothing == 0.0:
        return nll
    k = x.shape[-1]
    s = smoothing * k / (k - 1)
    return (1 - s) * nll - s * log_probs.mean(-1)


class ThreadGroup:
    """All-reduce over ``size`` threads (one per simulated tensor-parallel rank)."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def reducers(self, rank):
        def reduce(t, op):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()
            return out

        return (lambda t: reduce(t, "max")), (lambda t: reduce(t, "sum"))


def run_tp(logits, target, tp, smoothing, grad_loss):
    """Split the vocab over ``tp`` thread ranks; return (loss of rank 0, full logits grad)."""
    shards = [s.detach().clone().requires_grad_() for s in logits.chunk(tp, dim=-1)]
    starts = [sum(s.shape[-1] for s in shards[:r]) for r in range(tp)]
    group, losses, errors = ThreadGroup(tp), [None] * tp, []

    def rank_main(r):
        try:
            rmax, rsum = group.reducers(r)
            loss = vocab_parallel_cross_entropy(shards[r], target, vocab_start_index=starts[r],
                                                label_smoothing=smoothing, all_reduce_max=rmax,
                                                all_reduce_sum=rsum)
            loss.backward(grad_loss)
            losses[r] = loss
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for other in losses[1:]:
        torch.testing.assert_close(other, losses[0], rtol=0, atol=0)
    return losses[0], torch.cat([s.grad for s in shards], dim=-1)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=25, deadline=None)
@given(tokens=st.lists(st.integers(1, 5), min_size=1, max_size=2), tp=st.sampled_from([1, 2, 3]),
       per_rank=st.integers(1, 40), smoothing=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 2**16))
def test_cross_entropy_matches_fp64_reference(dtype_name, tokens, tp, per_rank, smoothing, seed):
    dtype = DTYPES[dtype_name]
    vocab = tp * per_rank
    if smoothing and vocab < 2:
        vocab, per_rank = 2 * tp, 2
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*tokens, vocab, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab, tuple(tokens), generator=gen)
    grad_loss = torch.rand(tuple(tokens), generator=gen)

    if tp == 1:  # no process group, no callables
        leaf = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(leaf, target, label_smoothing=smoothing)
        loss.backward(grad_loss)
        grad = leaf.grad
    else:
        loss, grad = run_tp(logits, target, tp, smoothing, grad_loss)

    ref_leaf = logits.double().requires_grad_()
    ref = reference(ref_leaf, target, smoothing)
    ref.backward(grad_loss.double())
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert_accurate(loss, ref, torch.float32, "loss")
    assert_accurate(grad, ref_leaf.grad, dtype, "dlogits")


def test_cross_entropy_through_a_process_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        logits = torch.randn(4, 3, 11)
        target = torch.randint(0, 11, (4, 3))
        loss = vocab_parallel_cross_entropy(logits, target, group=dist.group.WORLD)
        torch.testing.assert_close(loss.double(), reference(logits, target, 0.0))
    finally:
        if created:
            dist.destroy_process_group()


def test_cross_entropy_invalid_inputs():
    logits, target = torch.randn(3, 8), torch.randint(0, 8, (3,))
    with pytest.raises(ValueError, match=r"target shape \(2,\) must equal logits shape"):
        vocab_parallel_cross_entropy(logits, target[:2])
    with pytest.raises(TypeError, match=r"target must be an int64/int32 tensor"):
        vocab_parallel_cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match=r"both all_reduce_max and all_reduce_sum, or neither"):
        vocab_parallel_cross_entropy(logits, target, all_reduce_max=lambda t: t)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
