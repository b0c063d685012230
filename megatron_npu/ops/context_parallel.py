"""Context-parallel core attention: Megatron's ``--cp-comm-type`` on the device's fused attention.

Each rank of the context-parallel group holds ``s / CP`` rows of the sequence, Megatron-LM's
load-balanced chunks (``get_batch_on_this_cp_rank``: the sequence cut into ``2 CP`` chunks, rank
``r`` holding chunks ``r`` and ``2 CP - 1 - r``). Queries ``[s_local, b, n, d]``, keys and values
``[s_local, b, ng, d]``; the output ``[s_local, b, n * d]`` is exact attention over the whole
sequence for the local queries. The comm types:

* ``p2p``: ring attention (:mod:`megatron_npu.ops.ring_attention`); causal or full attention.
* ``a2a`` (Ulysses): an all-to-all trades heads for sequence, so each rank holds the whole
  sequence for ``n / CP`` of the heads; one fused attention over the sequence in its natural
  order (causal masks and sliding windows as on one device); the inverse all-to-all returns the
  local rows with every head. Key/value heads that CP does not divide are shared out to the
  query heads first.
* ``allgather``: keys and values are all-gathered and put in natural order; each local chunk's
  queries attend the keys up to their own end (bottom-right aligned, so windows apply as usual).
  The key/value gradients are summed over the group and each rank keeps its own rows.

* ``a2a+p2p`` (``--hierarchical-context-parallel-sizes A P``, CP = A x P): ``group`` is
  Megatron's pair of hierarchical groups, ``A`` consecutive context-parallel ranks (the
  all-to-all) and ``P`` ranks ``A`` apart (the ring). The all-to-all within the inner group
  gives each rank its group's rows for ``n / A`` heads; those rows are the load-balanced chunks
  of a ``P``-rank sequence (ring rank ``j`` holds super-chunks ``j`` and ``2P - 1 - j``, each
  ``A`` consecutive chunks), so the ring runs over the outer group unchanged; the inverse
  all-to-all returns every head. Causal or full attention, as the ring.

The attention itself is :func:`megatron_npu.ops.attention.fused_attention` (``npu_fusion_attention``
on the NPU), or the ring's blocks; the collectives are torch.distributed's, over the group's
backend (gloo on ``cpu`` and ``npu-emulated``, hccl on the NPU).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_npu.ops.attention import MAX_TOKENS, fused_attention
from megatron_npu.ops.ring_attention import ring_attention

_OP = "context_parallel_attention"
#: Megatron's ``--cp-comm-type`` values the adaptor serves.
COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
#: Megatron's values it refuses, with the reason (none today; kept for the option checks).
REFUSED_COMM_TYPES: dict[str, str] = {}


class ContextParallelError(ValueError):
    """A context-parallel attention the adaptor cannot compute (named, one line)."""


def chunk_order(cp: int) -> list[int]:
    """Natural chunk index of each chunk in rank order: rank ``r`` holds ``r, 2 CP - 1 - r``."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def local_rows(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a whole sequence (dim 0), as Megatron-LM's
    ``get_batch_on_this_cp_rank`` splits a batch: chunks ``rank`` and ``2 CP - 1 - rank``."""
    chunks = x.chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def to_natural(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Rows in rank order (``cp`` ranks' load-balanced chunks, dim 0) -> natural order."""
    chunks = x.chunk(2 * cp)
    order = chunk_order(cp)
    return torch.cat([chunks[order.index(m)] for m in range(2 * cp)])


def to_rank_order(x: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of :func:`to_natural`."""
    chunks = x.chunk(2 * cp)
    return torch.cat([chunks[m] for m in chunk_order(cp)])


# ----------------------------------------------------------------------------- collectives


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` ``[cp, ...]``: part ``j`` goes to rank ``j``;
    returns the parts received, ``[cp, ...]``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


class _HeadsToSequence(torch.autograd.Function):
    """``[s_l, b, n, d]`` -> ``[cp s_l, b, n / cp, d]`` (rows in rank order); backward inverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    s, b, n, d = x.shape
    parts = x.reshape(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4)
    return _all_to_all(parts, group).reshape(cp * s, b, n // cp, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    total, b, heads, d = x.shape
    received = _all_to_all(x.reshape(cp, total // cp, b, heads, d), group)
    return received.permute(1, 2, 0, 3, 4).reshape(total // cp, b, cp * heads, d)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 in rank order; the backward sums the gradient over the group and
    keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


# ------------------------------------------------------------------------------ comm types


def _sbh(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], -1)


def _a2a(q, k, v, group, *, causal, scale, dropout_p, pre_tokens, next_tokens):
    cp = dist.get_world_size(group)
    k, v = _shared_heads(q, k, v, cp, "a2a")
    q, k, v = (_HeadsToSequence.apply(t, group) for t in (q, k, v))
    reorder = causal or pre_tokens < MAX_TOKENS or next_tokens < MAX_TOKENS
    if reorder:
        q, k, v = (to_natural(t, cp) for t in (q, k, v))
    out = fused_attention(
        _sbh(q),
        _sbh(k),
        _sbh(v),
        head_num=q.shape[2],
        input_layout="SBH",
        causal=causal,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        scale=scale,
        dropout_p=dropout_p,
    )
    out = out.view(q.shape)
    if reorder:
        out = to_rank_order(out, cp)
    return _sbh(_SequenceToHeads.apply(out, group))


def _shared_heads(q, k, v, size: int, comm: str):
    """Key/value heads an all-to-all over ``size`` ranks can split (repeated to the query heads
    when ``size`` does not divide them); a head count it cannot split is a named error."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % size:
        raise ContextParallelError(
            f"{_OP}: --cp-comm-type {comm} shares the {heads} attention "
            f"heads (per tensor-parallel rank) out over {size} "
            "context-parallel ranks: the head count must be a multiple "
            "of that size"
        )
    if kv_heads % size:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    return k, v


def _to_super_chunks(x: torch.Tensor, inner: int) -> torch.Tensor:
    """Rows gathered from ``inner`` consecutive ranks (each its chunk ``c_i`` then its mirror
    ``m_i``) -> ``c_0 .. c_{A-1}, m_{A-1} .. m_0``: the two super-chunks in natural order."""
    parts = x.chunk(2 * inner)
    return torch.cat([*parts[0::2], *reversed(parts[1::2])])


def _from_super_chunks(x: torch.Tensor, inner: int) -> torch.Tensor:
    parts = x.chunk(2 * inner)
    firsts, seconds = parts[:inner], list(reversed(parts[inner:]))
    return torch.cat([t for pair in zip(firsts, seconds, strict=True) for t in pair])


def _a2a_p2p(q, k, v, groups, *, causal, scale, dropout_p):
    inner_group, ring_group = groups
    inner = dist.get_world_size(inner_group)
    k, v = _shared_heads(q, k, v, inner, "a2a+p2p")
    q, k, v = (_to_super_chunks(_HeadsToSequence.apply(t, inner_group), inner) for t in (q, k, v))
    if dist.get_world_size(ring_group) == 1:  # sizes [A, 1]: the rows are the whole sequence
        out = fused_attention(
            _sbh(q),
            _sbh(k),
            _sbh(v),
            head_num=q.shape[2],
            input_layout="SBH",
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
        )
    else:
        out = ring_attention(q, k, v, ring_group, causal=causal, scale=scale, dropout_p=dropout_p)
    out = _from_super_chunks(out.view(q.shape), inner)
    return _sbh(_SequenceToHeads.apply(out, inner_group))


def _group_size(group) -> int:
    """The context-parallel size: one group's, or the product of a hierarchical pair's."""
    if isinstance(group, list | tuple):
        return math.prod(dist.get_world_size(g) for g in group)
    return dist.get_world_size(group)


def _allgather(q, k, v, group, *, causal, scale, dropout_p, pre_tokens, next_tokens):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    k, v = (to_natural(_GatherRows.apply(t, group), cp) for t in (k, v))
    heads = q.shape[2]
    windowed = pre_tokens < MAX_TOKENS or next_tokens < MAX_TOKENS
    if not causal and not windowed:
        return fused_attention(
            _sbh(q),
            _sbh(k),
            _sbh(v),
            head_num=heads,
            input_layout="SBH",
            scale=scale,
            dropout_p=dropout_p,
        )
    if not causal:
        raise ContextParallelError(
            f"{_OP}: a sliding window without a causal mask is not served under context parallelism"
        )
    chunk = q.shape[0] // 2
    outs = []
    for index, natural in enumerate((rank, 2 * cp - 1 - rank)):
        end = (natural + 1) * chunk  # keys up to the chunk's own end, bottom-right aligned
        rows = q[index * chunk : (index + 1) * chunk]
        outs.append(
            fused_attention(
                _sbh(rows),
                _sbh(k[:end]),
                _sbh(v[:end]),
                head_num=heads,
                input_layout="SBH",
                causal=True,
                pre_tokens=pre_tokens,
                next_tokens=next_tokens,
                scale=scale,
                dropout_p=dropout_p,
            )
        )
    return torch.cat(outs)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    *,
    comm_type: str = "p2p",
    causal: bool,
    scale: float | None = None,
    dropout_p: float = 0.0,
    pre_tokens: int = MAX_TOKENS,
    next_tokens: int = MAX_TOKENS,
) -> torch.Tensor:
    """Core attention of this rank's load-balanced rows over the context-parallel sequence
    (module docstring). ``pre_tokens`` / ``next_tokens``: the window, as in
    :func:`~megatron_npu.ops.attention.fused_attention`."""
    if comm_type in REFUSED_COMM_TYPES:
        raise ContextParallelError(
            f"{_OP}: --cp-comm-type {comm_type}: {REFUSED_COMM_TYPES[comm_type]}"
        )
    if comm_type not in COMM_TYPES:
        raise ContextParallelError(
            f"{_OP}: unknown --cp-comm-type {comm_type!r}; served: {', '.join(COMM_TYPES)}"
        )
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ContextParallelError(
            f"{_OP}: query [s, b, n, d] and key/value [s, b, ng, d] "
            f"expected, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if query.shape[0] % 2:
        raise ContextParallelError(
            f"{_OP}: each rank holds two load-balanced chunks of the "
            f"sequence, so its {query.shape[0]} rows must be an even "
            "count (the sequence length a multiple of 2 x CP)"
        )
    hierarchical = comm_type == "a2a+p2p"
    if hierarchical != isinstance(group, list | tuple):
        raise ContextParallelError(
            f"{_OP}: --cp-comm-type a2a+p2p takes Megatron's pair of "
            "hierarchical context-parallel groups, every other comm type "
            "one group"
        )
    total = query.shape[0] * _group_size(group)
    if pre_tokens >= total - 1:  # a window at least the sequence long restricts nothing
        pre_tokens = MAX_TOKENS
    if causal or next_tokens >= total - 1:  # causality caps the right edge at 0
        next_tokens = MAX_TOKENS
    windowed = pre_tokens < MAX_TOKENS or next_tokens < MAX_TOKENS
    kwargs = dict(causal=causal, scale=scale, dropout_p=dropout_p)
    if comm_type in ("p2p", "a2a+p2p"):
        if windowed:
            raise ContextParallelError(
                f"{_OP}: a sliding window is not served with "
                f"--cp-comm-type {comm_type}; use a2a or allgather"
            )
        if hierarchical:
            return _a2a_p2p(query, key, value, group, **kwargs)
        return ring_attention(query, key, value, group, **kwargs)
    kwargs.update(pre_tokens=pre_tokens, next_tokens=next_tokens)
    if comm_type == "a2a":
        return _a2a(query, key, value, group, **kwargs)
    return _allgather(query, key, value, group, **kwargs)
