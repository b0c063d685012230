"""Vocab-parallel cross entropy: TP=1 without a process group, TP>1 on threads with reduce
callables, and a real (single-rank gloo) process group, against plain fp64."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron_npu.parity.verdict import require_accurate

from megatron_npu.ops.cross_entropy import vocab_parallel_cross_entropy

from ._paths import native_kernels_around_each_test  # noqa: F401

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def reference(logits, target, smoothing, dtype=torch.float64):
    """Megatron's loss (label smoothing over the other classes) computed plainly in ``dtype``:
    fp64 is the reference; fp32 is the stock computation the kernel's loss and gradient are
    benchmarked against, whose error bounds a loss that cancels to near zero (a confident right
    answer)."""
    x = logits.to(dtype)
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
            loss = vocab_parallel_cross_entropy(
                shards[r],
                target,
                vocab_start_index=starts[r],
                label_smoothing=smoothing,
                all_reduce_max=rmax,
                all_reduce_sum=rsum,
            )
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
@given(
    tokens=st.lists(st.integers(1, 5), min_size=1, max_size=2),
    tp=st.sampled_from([1, 2, 3]),
    per_rank=st.integers(1, 40),
    smoothing=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
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
    stock_leaf = logits.clone().requires_grad_()
    stock = reference(stock_leaf, target, smoothing, torch.float32)
    stock.backward(grad_loss)
    require_accurate(loss, ref, torch.float32, "loss", benchmark=stock.detach())
    # the stock gradient (softmax less the one-hot target, in fp32) bounds one that cancels: a
    # confident right answer's target entry is 1 - p with p within a few ulp of 1
    require_accurate(grad, ref_leaf.grad, dtype, "dlogits", benchmark=stock_leaf.grad)


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


# ----------------------------------------------------------------------------- memory and Megatron


def test_chunked_rows_and_in_place_gradient_match_the_reference(monkeypatch):
    """fp32 activation logits become the softmax, then their gradient, in their own storage; a
    leaf keeps its values and is read in row chunks (a tiny chunk budget forces many)."""
    import megatron_npu.ops.cross_entropy as ce

    monkeypatch.setattr(ce, "CHUNK_BYTES", 4 * 7 * 3)  # 3 rows of a 7-wide vocab per chunk
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(4, 5, 7, generator=gen, requires_grad=True)
    target = torch.randint(0, 7, (4, 5), generator=gen)
    grad_loss = torch.rand(4, 5, generator=gen)
    logits = base * 1.0  # an activation, like the output layer's
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1)
    loss.backward(grad_loss)
    ref_leaf = base.detach().double().requires_grad_()
    ref = reference(ref_leaf, target, 0.1)
    ref.backward(grad_loss.double())
    require_accurate(loss, ref, torch.float32, "loss")
    require_accurate(base.grad, ref_leaf.grad, torch.float32, "dlogits")
    assert torch.equal(logits.detach(), base.grad)  # the activation's storage holds its grad

    leaf = base.detach().clone().requires_grad_()
    before = leaf.detach().clone()
    chunked = vocab_parallel_cross_entropy(leaf, target, label_smoothing=0.1)
    chunked.backward(grad_loss)
    assert torch.equal(leaf.detach(), before)
    require_accurate(chunked, ref, torch.float32, "chunked loss")
    require_accurate(leaf.grad, ref_leaf.grad, torch.float32, "chunked dlogits")
    # a non-contiguous activation cannot be worked on in place: it keeps its values
    strided = (base * 1.0).transpose(0, 1)
    kept = strided.detach().clone()
    vocab_parallel_cross_entropy(strided, target.t()).sum().backward()
    assert torch.equal(strided.detach(), kept)


def test_in_place_gradient_refuses_to_corrupt_another_user_of_the_logits():
    base = torch.randn(3, 6, requires_grad=True)
    logits = base * 1.0
    squared = logits * logits  # saves logits itself for its backward
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, 2])).sum() + squared.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _MegatronThreads:
    """Megatron's own ``vocab_parallel_cross_entropy`` at TP ``size`` on threads: its
    parallel-state getters read the thread's rank and ``torch.distributed.all_reduce`` reduces
    over the threads."""

    def __init__(self, size, monkeypatch):
        import megatron.core.tensor_parallel.cross_entropy as mce

        self.group, self.local = ThreadGroup(size), threading.local()
        monkeypatch.setattr(mce, "get_tensor_model_parallel_rank", lambda: self.local.rank)
        monkeypatch.setattr(mce, "get_tensor_model_parallel_world_size", lambda: size)
        monkeypatch.setattr(mce, "get_tensor_model_parallel_group", lambda: None)
        monkeypatch.setattr(dist, "all_reduce", self._all_reduce)
        self.fn = mce.vocab_parallel_cross_entropy

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rmax, rsum = self.group.reducers(self.local.rank)
        tensor.copy_((rmax if op == dist.ReduceOp.MAX else rsum)(tensor))

    def run(self, logits, target, smoothing):
        shards = logits.chunk(self.group.size, dim=-1)
        losses = [None] * self.group.size

        def rank_main(r):
            self.local.rank = r
            losses[r] = self.fn(shards[r].clone(), target, smoothing)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(shards))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return losses


def test_equals_megatron_at_tp2_and_documents_its_label_smoothing(monkeypatch):
    """Without smoothing the op equals Megatron's at TP2. With smoothing Megatron averages the
    log-probabilities over each rank's shard (each rank gets another loss); the op smooths over
    the global vocab, so its loss is the same on every rank and equals Megatron's at TP1 -- the
    documented deliberate difference that keeps TP layouts equivalent."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 2, 16, generator=gen) * 2
    target = torch.randint(0, 16, (3, 2), generator=gen)
    megatron = _MegatronThreads(2, monkeypatch)
    ours, _ = run_tp(logits, target, 2, 0.0, torch.ones(3, 2))
    for rank_loss in megatron.run(logits, target, 0.0):
        torch.testing.assert_close(ours, rank_loss, rtol=1e-6, atol=1e-6)

    smoothed, _ = run_tp(logits, target, 2, 0.1, torch.ones(3, 2))
    meg_tp2 = megatron.run(logits, target, 0.1)
    assert (meg_tp2[0] - meg_tp2[1]).abs().max() > 1e-3  # Megatron: rank-dependent loss
    megatron_tp1 = _MegatronThreads(1, monkeypatch).run(logits, target, 0.1)[0]
    torch.testing.assert_close(smoothed, megatron_tp1, rtol=1e-6, atol=1e-6)
    local = logits.chunk(2, dim=-1)
    for rank, rank_loss in enumerate(meg_tp2):  # Megatron's formula on the shard's vocab
        lp = (logits.double().log_softmax(-1)).chunk(2, dim=-1)[rank]
        k = local[rank].shape[-1]
        s = 0.1 * k / (k - 1)
        nll = -logits.double().log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(
            rank_loss.double(), (1 - s) * nll - s * lp.mean(-1), rtol=1e-5, atol=1e-5
        )
