"""Ring attention: context parallelism's ``p2p`` comm type, on fused-attention blocks.

Each rank of the context-parallel group holds a slice of the sequence. Its queries meet every
rank's keys and values one block at a time while the blocks travel around the ring (rank ``r``
sends to ``r + 1`` and receives from ``r - 1``, the next block in flight while the current one is
computed). The blocks' partial outputs are merged with their softmax statistics, so the result is
exact softmax attention over the whole sequence; no rank ever holds more than two key/value
blocks.

**Load-balanced causal chunks** (Megatron-LM's ``get_batch_on_this_cp_rank``, which the rotary
embedding's ``get_pos_emb_on_this_cp_rank`` matches): the sequence is cut into ``2 CP`` chunks
and rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``, in that order. Under a causal mask the
block from rank ``src`` is then, for rank ``r``:

* ``src == r``: causal over the rank's own two chunks (their positions increase);
* ``src < r``: every local query sees the first chunk of the block (positions below ``r``'s
  first chunk) and none of its second chunk;
* ``src > r``: only the second local chunk sees anything, and it sees the whole block;

so every step is one fully visible or one causal block of equal halves, never a masked-out row.
Without a causal mask every step is the full block.

**Merge** (``npu_ring_attention_update``'s definition): with per-row maxima ``m``, sums ``l``
and outputs ``o`` of two partial softmaxes, ``m = max(m1, m2)``, ``l = l1 e^(m1-m) + l2 e^(m2-m)``
and ``o = (o1 l1 e^(m1-m) + o2 l2 e^(m2-m)) / l``. The native path keeps the equivalent
log-sum-exp ``log l + m`` per row.

**Backward**: the keys and values travel around the ring again, each carrying the gradient of its
block accumulated so far; every rank adds its queries' share (the fused-attention gradient of the
block given the *merged* output and statistics) and passes both on, so after one more hop every
block's key/value gradient is back on its owner. Gradients accumulate in fp32.

**Blocks**: on the NPU ``npu_fusion_attention`` (``SBH``, causal blocks in ``sparse_mode`` 3)
returns the block's ``softmax_max`` / ``softmax_sum``; ``npu_ring_attention_update`` merges the
block outputs in fp32 (rounded to the input dtype once, at the end) and
``npu_fusion_attention_grad`` differentiates, with the dropout seed each forward block reported.
The native path runs the CPU flash-attention kernel and its backward (output and log-sum-exp), or,
with attention dropout, the same math written out with a dropout mask drawn from a per-block seed
(the CPU flash kernel has no dropout), so the backward redraws the forward's mask.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_npu.ops.attention import (
    MAX_TOKENS,
    SPARSE_MODE_DEFAULT,
    SPARSE_MODE_RIGHT_DOWN_CAUSAL,
    compressed_causal_mask,
)
from megatron_npu.ops.kernels import npu_kernels

_OP = "ring_attention"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_SEED_HIGH = 2**62


class _Part(NamedTuple):
    """A (partial) attention result for some query rows: fp32 output, ``[s, b, n, d]`` (native)
    or ``[s, b, n * d]`` (NPU), and the backend's per-row statistics."""

    out: torch.Tensor
    stats: tuple[torch.Tensor, ...]


# ------------------------------------------------------------------------ native blocks


class NativeBlocks:
    """Blocks on torch: the CPU flash kernel (no dropout), else explicit math. Queries, keys and
    values are ``[s, b, n, d]``; key/value heads may be fewer (grouped-query attention)."""

    def __init__(self, heads: int, scale: float, dropout_p: float) -> None:
        self.heads, self.scale, self.dropout_p = heads, scale, dropout_p

    @staticmethod
    def _bnsd(x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        x = x.permute(1, 2, 0, 3)
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # fp64 stays fp64
        if heads is not None and x.shape[1] != heads:  # query head h reads kv head h // group
            x = x.repeat_interleave(heads // x.shape[1], dim=1)
        return x.contiguous()

    def _scores(self, q, k, causal: bool) -> torch.Tensor:
        """Scaled scores ``[b, n, sq, skv]``, causal positions above the diagonal at -inf."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if causal:
            sq, skv = scores.shape[-2:]
            hidden = torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu_(1 + skv - sq)
            scores = scores.masked_fill(hidden, float("-inf"))
        return scores

    def _math(self, q, k, v, causal: bool, seed: int):
        """Scores, probabilities after dropout, and the row log-sum-exp, all ``[b, n, sq, skv]``
        / ``[b, n, sq]`` fp32."""
        scores = self._scores(q, k, causal)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        keep = self._keep_mask(probs, seed)
        return probs, probs * keep / (1.0 - self.dropout_p), lse

    def _keep_mask(self, probs: torch.Tensor, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=probs.device).manual_seed(seed)
        return torch.rand(probs.shape, generator=gen, device=probs.device) >= self.dropout_p

    def forward(self, q, k, v, causal: bool) -> tuple[_Part, Any]:
        qb, kb, vb = self._bnsd(q), self._bnsd(k, self.heads), self._bnsd(v, self.heads)
        if self.dropout_p == 0.0:
            out, lse = _flash(qb, kb, vb, 0.0, causal, scale=self.scale)
            seed = None
        else:
            seed = int(torch.randint(0, _SEED_HIGH, (1,)).item())  # under the caller's RNG
            _, dropped, lse = self._math(qb, kb, vb, causal, seed)
            out = torch.matmul(dropped, vb)
        return _Part(out.permute(2, 0, 1, 3), (lse.permute(2, 0, 1),)), seed

    @staticmethod
    def merge(acc: _Part, cur: _Part, rows: slice) -> _Part:
        (lse_a,), (lse_b,) = acc.stats, cur.stats
        lse_a_rows = lse_a[rows]
        lse = torch.logaddexp(lse_a_rows, lse_b)
        w_a, w_b = (lse_a_rows - lse).exp(), (lse_b - lse).exp()
        out = acc.out.clone()
        out[rows] = acc.out[rows] * w_a.unsqueeze(-1) + cur.out * w_b.unsqueeze(-1)
        lse_all = lse_a.clone()
        lse_all[rows] = lse
        return _Part(out, (lse_all,))

    @staticmethod
    def finish(acc: _Part, dtype: torch.dtype) -> torch.Tensor:
        return acc.out.flatten(2).to(dtype)

    @staticmethod
    def rows(part: _Part, rows: slice) -> _Part:
        return _Part(part.out[rows], tuple(s[rows] for s in part.stats))

    def backward(self, q, k, v, grad, part: _Part, causal: bool, seed):
        """(dq, dk, dv) in fp32 for one block, given the merged output and statistics of the
        block's query rows."""
        (lse,) = part.stats
        qb = self._bnsd(q)
        kb, vb = self._bnsd(k, self.heads), self._bnsd(v, self.heads)
        gb, ob = self._bnsd(grad), self._bnsd(part.out)
        lse_b = lse.permute(1, 2, 0).contiguous()
        if seed is None:
            dq, dk, dv = _flash_backward(gb, qb, kb, vb, ob, lse_b, 0.0, causal, scale=self.scale)
        else:
            probs = torch.exp(
                self._scores(qb, kb, causal) - lse_b.unsqueeze(-1)
            )  # normalised by the merged sum
            keep = self._keep_mask(probs, seed) / (1.0 - self.dropout_p)
            dropped = probs * keep
            dv = torch.matmul(dropped.transpose(-1, -2), gb)
            dprobs = torch.matmul(gb, vb.transpose(-1, -2)) * keep
            delta = (gb * ob).sum(dim=-1, keepdim=True)  # rowsum(dO * O) of the merged output
            dscores = probs * (dprobs - delta) * self.scale
            dq = torch.matmul(dscores, kb)
            dk = torch.matmul(dscores.transpose(-1, -2), qb)
        kv_heads = k.shape[2]
        if kv_heads != self.heads:  # grouped-query heads: sum the group's gradients
            group = self.heads // kv_heads
            dk = dk.unflatten(1, (kv_heads, group)).sum(2)
            dv = dv.unflatten(1, (kv_heads, group)).sum(2)
        return tuple(
            t.permute(2, 0, 1, 3).to(torch.promote_types(t.dtype, torch.float32))
            for t in (dq, dk, dv)
        )


# --------------------------------------------------------------------------- NPU blocks


class NpuBlocks:
    """Blocks on ``npu_fusion_attention`` / ``npu_ring_attention_update`` /
    ``npu_fusion_attention_grad`` (torch_npu or its emulation), ``SBH`` layout."""

    def __init__(self, kernels: ModuleType, heads: int, scale: float, dropout_p: float) -> None:
        self.kernels, self.heads, self.scale = kernels, heads, scale
        self.keep_prob = 1.0 - dropout_p

    @staticmethod
    def _sbh(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], -1)

    def _mask(self, causal: bool, device: torch.device) -> dict:
        if causal:
            return dict(
                atten_mask=compressed_causal_mask(device),
                sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL,
                pre_tockens=MAX_TOKENS,
                next_tockens=0,
            )
        return dict(
            atten_mask=None,
            sparse_mode=SPARSE_MODE_DEFAULT,
            pre_tockens=MAX_TOKENS,
            next_tockens=MAX_TOKENS,
        )

    def forward(self, q, k, v, causal: bool) -> tuple[_Part, Any]:
        out, smax, ssum, _, seed, offset, numels = self.kernels.npu_fusion_attention(
            self._sbh(q),
            self._sbh(k),
            self._sbh(v),
            self.heads,
            "SBH",
            scale=self.scale,
            keep_prob=self.keep_prob,
            **self._mask(causal, q.device),
        )
        # merged in fp32 (the update kernel's fp32 form), rounded once by finish()
        return _Part(out.float(), (smax, ssum)), (seed, offset, numels)

    def merge(self, acc: _Part, cur: _Part, rows: slice) -> _Part:
        smax, ssum = acc.stats
        out_r, max_r, sum_r = self.kernels.npu_ring_attention_update(
            acc.out[rows],
            smax[:, :, rows],
            ssum[:, :, rows],
            cur.out,
            *cur.stats,
            input_layout="SBH",
        )
        if rows == slice(None):
            return _Part(out_r, (max_r, sum_r))
        out, smax, ssum = acc.out.clone(), smax.clone(), ssum.clone()
        out[rows], smax[:, :, rows], ssum[:, :, rows] = out_r, max_r, sum_r
        return _Part(out, (smax, ssum))

    @staticmethod
    def finish(acc: _Part, dtype: torch.dtype) -> torch.Tensor:
        return acc.out.to(dtype)

    @staticmethod
    def rows(part: _Part, rows: slice) -> _Part:
        return _Part(part.out[rows], tuple(s[:, :, rows] for s in part.stats))

    def backward(self, q, k, v, grad, part: _Part, causal: bool, rng):
        seed, offset, numels = rng
        smax, ssum = part.stats
        dq, dk, dv = self.kernels.npu_fusion_attention_grad(
            self._sbh(q),
            self._sbh(k),
            self._sbh(v),
            self._sbh(grad).to(q.dtype),
            self.heads,
            "SBH",
            softmax_max=smax,
            softmax_sum=ssum,
            attention_in=part.out.to(q.dtype),
            scale_value=self.scale,
            keep_prob=self.keep_prob,
            seed=seed,
            offset=offset,
            numels=numels,
            **self._mask(causal, q.device),
        )[:3]
        return tuple(g.float().view(t.shape) for g, t in zip((dq, dk, dv), (q, k, v), strict=True))


# ---------------------------------------------------------------------------------- ring


def _peers(group) -> tuple[int, int]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return (
        dist.get_global_rank(group, (rank + 1) % size),
        dist.get_global_rank(group, (rank - 1) % size),
    )


def _exchange(tensor: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Send ``tensor`` to the next rank, receive the previous rank's into a new buffer."""
    nxt, prv = _peers(group)
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, tensor, nxt, group), dist.P2POp(dist.irecv, received, prv, group)]
    )
    return received, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _Step(NamedTuple):
    """What rank ``r`` computes with the block of rank ``src``: query rows, key/value rows of
    the block, and whether the block is causal."""

    q_rows: slice
    kv_rows: slice
    causal: bool


def ring_steps(rank: int, size: int, local: int, causal: bool) -> list[_Step]:
    """The block each ring step computes (module docstring), for ``local`` query rows."""
    every = slice(None)
    if not causal:
        return [_Step(every, every, False) for _ in range(size)]
    half = local // 2
    steps = []
    for i in range(size):
        src = (rank - i) % size
        if src == rank:
            steps.append(_Step(every, every, True))
        elif src < rank:
            steps.append(_Step(every, slice(0, half), False))
        else:
            steps.append(_Step(slice(half, None), every, False))
    return steps


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, blocks):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        steps = ring_steps(rank, size, q.shape[0], causal)
        kv = torch.stack((k, v))
        acc, rngs = None, []
        for i, step in enumerate(steps):
            pending = _exchange(kv, group) if i + 1 < size else None
            part, rng = blocks.forward(
                q[step.q_rows], kv[0][step.kv_rows], kv[1][step.kv_rows], step.causal
            )
            # step 0 is the rank's own block, which covers every query row
            acc = part if acc is None else blocks.merge(acc, part, step.q_rows)
            rngs.append(rng)
            if pending is not None:
                kv, works = pending
                _wait(works)
        ctx.group, ctx.blocks, ctx.steps, ctx.rngs = group, blocks, steps, rngs
        ctx.save_for_backward(q, k, v, acc.out, *acc.stats)
        return blocks.finish(acc, q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, *stats = ctx.saved_tensors
        blocks, group, size = ctx.blocks, ctx.group, len(ctx.steps)
        merged = _Part(out, tuple(stats))
        grad = grad.reshape(q.shape).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for i, (step, rng) in enumerate(zip(ctx.steps, ctx.rngs, strict=True)):
            pending = _exchange(kv, group) if i + 1 < size else None
            rows = blocks.rows(merged, step.q_rows)
            gq, gk, gv = blocks.backward(
                q[step.q_rows],
                kv[0][step.kv_rows],
                kv[1][step.kv_rows],
                grad[step.q_rows],
                rows,
                step.causal,
                rng,
            )
            dq[step.q_rows] += gq
            dkv[0][step.kv_rows] += gk
            dkv[1][step.kv_rows] += gv
            # the block's gradient follows the block; after the last step one more hop home
            dkv, works = _exchange(dkv, group)
            _wait(works)
            if pending is not None:
                kv, works = pending
                _wait(works)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    *,
    causal: bool,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of this rank's queries ``[s, b, n, d]`` over the whole context-parallel
    sequence; keys/values ``[s, b, ng, d]``; output ``[s, b, n * d]``. ``group`` is the
    context-parallel process group; with ``causal`` the local rows are Megatron's two
    load-balanced chunks (an even count)."""
    if query.dim() != 4 or key.shape != value.shape or key.shape[:2] != query.shape[:2]:
        raise ValueError(
            f"{_OP}: query [s, b, n, d] and key/value [s, b, ng, d] of the same "
            f"s and b expected, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    heads, kv_heads = query.shape[2], key.shape[2]
    if heads % kv_heads:
        raise ValueError(
            f"{_OP}: {heads} query heads are not a multiple of {kv_heads} key/value heads"
        )
    if causal and query.shape[0] % 2:
        raise ValueError(
            f"{_OP}: causal context parallelism splits each rank's "
            f"{query.shape[0]} rows into two chunks: the count must be even"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{_OP}: dropout_p must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[3])
    kernels = npu_kernels(
        "npu_fusion_attention", "npu_fusion_attention_grad", "npu_ring_attention_update"
    )
    blocks = (
        NpuBlocks(kernels, heads, scale, dropout_p)
        if kernels is not None
        else NativeBlocks(heads, scale, dropout_p)
    )
    return _RingAttention.apply(query, key, value, group, causal, blocks)
