"""The CPU band paths of a sliding window: flash-kernel pieces merged by their log-sum-exp, per
query block and batched over blocks (the C++ band kernel's forward where it builds)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron_npu.ops.cpu_band_kernel import band_attention_forward

#
# A window (``lo``/``hi`` bounds) seen by a block of ``n <= hi - lo`` consecutive queries splits
# into three key ranges, each of which the flash kernel computes without a mask:
#
# * the left triangle ``[a, a + n)``: query ``t`` sees key ``u`` iff ``u >= t``, i.e. causal
#   after reversing both the queries and the keys;
# * the middle ``[a + n, b)``: seen by every query of the block (no mask);
# * the right triangle ``[b, b + n)``: query ``t`` sees key ``u`` iff ``u <= t`` (causal),
#
# with ``a``/``b`` the first query's lowest/highest visible key. Keys cut off by the sequence
# ends are handled by trimming the piece's queries: a triangle that loses keys at its start keeps
# the kernel's top-left causal alignment on the keys left, one that loses keys at its far end
# drops the queries that would only have seen those keys. The pieces' outputs are merged with
# their log-sum-exps. The backward calls the kernel's backward per piece with the *merged* output
# and log-sum-exp: that is exactly the gradient of the whole softmax restricted to the piece's
# keys, so the pieces' gradients add up to the true one.
#
# The forward of both band paths is the C++ band kernel when it is available: it computes the
# same output and log-sum-exp with ~64 masked scores per query row where the flash pieces compute
# ~512 (the flash kernel's tiles are 256 queries x 512 keys, aligned to the piece's start), and
# the backward above works from those.

#: Query block of the band path: at most this many queries per block, and never more than the
#: window is wide (``hi - lo``). Windows narrower than ``BAND_MIN_BLOCK`` use the masked blocks.
BAND_MAX_BLOCK = 2048
BAND_MIN_BLOCK = 64

_FULL, _CAUSAL, _REVERSED_CAUSAL = "full", "causal", "reversed-causal"


class _Piece(NamedTuple):
    """Queries ``[q0, q1)`` against keys ``[k0, k1)``, unmasked or (reversed-)causal."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str


def band_plan(q: torch.Tensor, sq: int, skv: int, lo: int, hi: int):
    """The band path's pieces, or None where it does not apply (not CPU, or a window narrower
    than :data:`BAND_MIN_BLOCK`)."""
    width = hi - lo
    if q.device.type != "cpu" or width < BAND_MIN_BLOCK:
        return None
    offset, block = skv - sq, min(BAND_MAX_BLOCK, width)
    pieces = []
    for q0 in range(0, sq, block):
        n = min(sq, q0 + block) - q0
        a, b = q0 + offset + lo, q0 + offset + hi
        lost_at_end = max(0, a + n - skv)  # left triangle: its last queries see only these
        if a + n > 0 and lost_at_end < n:
            pieces.append(
                _Piece(q0, q0 + n - lost_at_end, max(a, 0), a + n - lost_at_end, _REVERSED_CAUSAL)
            )
        m0, m1 = max(a + n, 0), min(b, skv)
        if m1 > m0:
            pieces.append(_Piece(q0, q0 + n, m0, m1, _FULL))
        lost_at_start = max(0, -b)  # right triangle: its first queries see only these
        if b < skv and lost_at_start < n:
            pieces.append(
                _Piece(q0 + lost_at_start, q0 + n, b + lost_at_start, min(b + n, skv), _CAUSAL)
            )
    return tuple(pieces)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
#: slot of each piece kind in the merge buffers; reversed pieces live in reversed order.
_SLOTS = {_REVERSED_CAUSAL: 0, _FULL: 1, _CAUSAL: 2}


def _band_pieces(plan, sq: int, skv: int):
    """``(slot, causal, query rows, key columns)`` per piece, reversed pieces as rows/columns of
    the sequence-reversed tensors (so they run as plain causal pieces on them)."""
    for p in plan:
        if p.kind == _REVERSED_CAUSAL:
            rows, keys = slice(sq - p.q1, sq - p.q0), slice(skv - p.k1, skv - p.k0)
        else:
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        yield _SLOTS[p.kind], p.kind != _FULL, rows, keys


class BandAttention(torch.autograd.Function):
    """Windowed attention on (B, N, S, D) fp32 CPU tensors through the flash kernel's pieces.

    Work is batched to keep the number of kernel launches low: the sequences are reversed once
    for all reversed pieces, each piece writes its output and log-sum-exp into its slot of one
    buffer, and one log-sum-exp merge over the three slots produces the result.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan, bounds, scale):
        ctx.plan, ctx.scale = plan, scale
        b, n, sq, _ = q.shape
        skv = k.shape[2]
        kernel = band_attention_forward(
            *(t.reshape(b * n, -1, t.shape[3]) for t in (q, k, v)), *bounds, scale
        )
        if kernel is not None:  # the C++ forward computes the same output and log-sum-exp
            out, total = kernel[0].view(b, n, sq, -1), kernel[1].view(b, n, sq)
            ctx.save_for_backward(q, k, v, out, total)
            return out
        pieces = list(_band_pieces(plan, sq, skv))
        slots = sorted({slot for slot, *_ in pieces})  # only the kinds this window needs
        index = {slot: i for i, slot in enumerate(slots)}
        reversed_qkv = [t.flip(2) for t in (q, k, v)] if 0 in index else None
        outs = q.new_zeros(len(slots), b, n, sq, v.shape[3])
        lses = q.new_full((len(slots), b, n, sq), float("-inf"), dtype=torch.float32)
        for slot, causal, rows, keys in pieces:
            qq, kk, vv = reversed_qkv if slot == 0 else (q, k, v)
            out, lse = _flash(
                qq[:, :, rows], kk[:, :, keys], vv[:, :, keys], 0.0, causal, scale=scale
            )
            outs[index[slot], :, :, rows] = out
            lses[index[slot], :, :, rows] = lse
        if 0 in index:
            outs[0] = outs[0].flip(2)
            lses[0] = lses[0].flip(2)
        total = torch.logsumexp(lses, dim=0)
        weights = (lses - total).exp_()
        # rows that see no key at all stay zero (decided on the device: no host sync)
        weights = torch.where(torch.isfinite(total), weights, 0.0)
        out = (outs * weights.unsqueeze(-1)).sum(dim=0)
        ctx.save_for_backward(q, k, v, out, total)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        sq, skv = q.shape[2], k.shape[2]
        plain = (grad_out.contiguous(), q, k, v, out, lse)
        reversed_ = [t.flip(2) for t in plain]
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        reversed_grads = [torch.zeros_like(t) for t in (q, k, v)]
        for slot, causal, rows, keys in _band_pieces(ctx.plan, sq, skv):
            g, qq, kk, vv, oo, ll = reversed_ if slot == 0 else plain
            dq, dk, dv = reversed_grads if slot == 0 else grads
            gq, gk, gv = _flash_backward(
                g[:, :, rows],
                qq[:, :, rows],
                kk[:, :, keys],
                vv[:, :, keys],
                oo[:, :, rows],
                ll[:, :, rows],
                0.0,
                causal,
                scale=ctx.scale,
            )
            dq[:, :, rows] += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
        dq, dk, dv = (g.add_(r.flip(2)) for g, r in zip(grads, reversed_grads, strict=True))
        return dq, dk, dv, None, None, None


#
# For the common window, a causal sliding window over equally long queries and keys (query ``i``
# sees keys ``[i - w, i]``, ``w = pre_tokens``), the band pieces of all query blocks have the same
# shapes, so each kind runs as *one* kernel call with the blocks in the batch dimension instead of
# one call per block (the CPU flash kernel pays a lot per call and per small causal triangle).
# With query blocks of ``n <= w`` rows starting at query ``w``:
#
# * the head, queries ``[0, w)``: the window starts before key 0, so it is plain causal attention
#   on keys ``[0, w)`` (one call);
# * the interior, query block ``i`` = queries ``[w + i n, w + (i + 1) n)``:
#
#   - left triangle: keys ``[i n, (i + 1) n)``, reversed-causal (query ``t`` of the block sees key
#     ``u`` iff ``u >= t``; ``u == t`` is the key exactly ``w`` before the query), run as causal
#     on the blocks flipped along the sequence;
#   - middle: keys ``[(i + 1) n, w + i n)``, seen by the whole block; overlapping windows of the
#     keys, taken without a copy by ``unfold``;
#   - right triangle: keys ``[w + i n, w + (i + 1) n)``, causal.
#
# The left-triangle keys of the blocks tile ``[0, nb n)``, the right-triangle keys tile
# ``[w, w + nb n)``, so those are plain views of the key blocks; the middles overlap (each key is
# in up to ``ceil(w / n) - 1`` of them), so the backward adds their key/value gradients back one
# ``n``-wide column chunk at a time. A sequence whose interior is not a whole number of blocks is
# padded with zero rows at the end: the right triangle is causal, so no real query sees a padded
# key, and the padded rows' zero output gradient adds nothing to the real keys' gradients. The
# merge and the backward (merged output and log-sum-exp per piece) are those of the band path.

#: Most queries per block of the batched band path.
BATCHED_BAND_BLOCK = 2048
#: From this many queries per call on, the CPU flash kernel works in chunks of 256 queries
#: instead of 64 (or 32), which is markedly faster per key.
FLASH_LONG_QUERIES = 768


def batched_band_block(q: torch.Tensor, sq: int, skv: int, lo: int, hi: int) -> int:
    """Query block of the batched band path, or 0 where it does not apply (it needs CPU, equal
    query and key lengths and a causal sliding window, ``hi == 0``, at least
    :data:`BAND_MIN_BLOCK` wide).

    Half the window, up to :data:`BATCHED_BAND_BLOCK`; but the whole window where only that
    reaches :data:`FLASH_LONG_QUERIES`. The kernel's time follows the tiles it computes: a
    causal triangle wastes about half a key tile per row on its diagonal, smaller blocks waste
    less there but run smaller, slower tiles. Measured at B=1, N=4, S=8192, D=64, forward: on
    two cores window 2048 costs about the same with blocks of 64 to 1024, 1024 being the
    fastest more often; on two cores of a bigger host 1024 was fastest (forward and backward),
    windows 512, 1536 and 4096 preferred half the window, window 1000 whole-window blocks."""
    width = -lo
    if q.device.type != "cpu" or sq != skv or hi != 0 or width < BAND_MIN_BLOCK:
        return 0
    block = min(BATCHED_BAND_BLOCK, width // 2)
    if block < FLASH_LONG_QUERIES <= width:
        block = min(BATCHED_BAND_BLOCK, width)
    return max(1, block)


class BatchedBandAttention(torch.autograd.Function):
    """Causal sliding window of ``width`` on (B, N, S, D) fp32 CPU tensors: the band pieces of
    all query blocks batched into four flash calls (see the comment above)."""

    @staticmethod
    def _rows(x: torch.Tensor, length: int) -> torch.Tensor:
        """(B, N, S, D) -> contiguous (B*N, length, D), zero rows appended after S."""
        b, h, s, d = x.shape
        x = x.reshape(b * h, s, d)
        if length > s:
            x = F.pad(x, (0, 0, 0, length - s))
        return x.contiguous()

    @staticmethod
    def _layout(width: int, n: int, nb: int):
        """Views of (B*N, S', D) rows (or (B*N, S') log-sum-exps) that the pieces read."""

        def blocks(x, start):  # rows [start + i n, start + (i + 1) n) as batch entry i
            return x[:, start : start + nb * n].unflatten(1, (nb, n))

        def keys(x):  # (left flipped, middle or None, right) key windows of every block
            middle = None
            if width > n:  # window i is rows [(i + 1) n, w + i n): windows of w - n, step n
                middle = x.unfold(1, width - n, n).transpose(-1, -2)[:, 1 : 1 + nb]
            return blocks(x, 0).flip(2), middle, blocks(x, width)

        return blocks, keys

    @staticmethod
    def forward(ctx, q, k, v, width, n, scale):
        b, h, s, d = q.shape
        nb = -(-(s - width) // n)  # interior query blocks
        length = width + nb * n
        q, k, v = (BatchedBandAttention._rows(t, length) for t in (q, k, v))
        ctx.layout, ctx.scale = (b, h, s, width, n, nb), scale
        kernel = band_attention_forward(q, k, v, -width, 0, scale)
        if kernel is not None:  # the C++ forward computes the same output and log-sum-exp
            out, lse = kernel
            ctx.save_for_backward(q, k, v, out, lse)
            return out[:, :s].unflatten(0, (b, h))
        blocks, keys = BatchedBandAttention._layout(width, n, nb)
        out = q.new_empty(b * h, length, v.shape[2])
        lse = q.new_empty(b * h, length)
        # head: plain causal
        o, m = _flash(*(t[:, None, :width] for t in (q, k, v)), 0.0, True, scale=scale)
        out[:, :width], lse[:, :width] = o[:, 0], m[:, 0]
        # interior: one call per piece kind for all blocks
        qb = blocks(q, width)
        (kl, km, kr), (vl, vm, vr) = keys(k), keys(v)
        o_l, l_l = _flash(qb.flip(2), kl, vl, 0.0, True, scale=scale)
        o_r, l_r = _flash(qb, kr, vr, 0.0, True, scale=scale)
        outs, lses = [o_l.flip(2), o_r], [l_l.flip(2), l_r]
        if km is not None:
            o_m, l_m = _flash(qb, km, vm, 0.0, False, scale=scale)
            outs.append(o_m)
            lses.append(l_m)
        # log-sum-exp merge; every row sees its own key, so every total is finite
        lses = torch.stack(lses)
        torch.logsumexp(lses, dim=0, out=blocks(lse, width))
        weights = torch.softmax(lses, dim=0).unsqueeze(-1)  # exp(piece lse - total lse)
        merged = blocks(out, width)
        torch.mul(outs[0], weights[0], out=merged)
        for o, weight in zip(outs[1:], weights[1:], strict=True):
            merged.addcmul_(o, weight)
        ctx.save_for_backward(q, k, v, out, lse)
        return out[:, :s].unflatten(0, (b, h))

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, s, width, n, nb = ctx.layout
        scale = ctx.scale
        g = BatchedBandAttention._rows(grad_out, q.shape[1])
        blocks, keys = BatchedBandAttention._layout(width, n, nb)
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        # head
        head = (t[:, None, :width] for t in (g, q, k, v, out, lse))
        gq, gk, gv = _flash_backward(*head, 0.0, True, scale=scale)
        dq[:, :width], dk[:, :width], dv[:, :width] = gq[:, 0], gk[:, 0], gv[:, 0]
        # interior: every piece with the merged output and log-sum-exp of its queries
        gb, qb, ob, lb = (blocks(t, width) for t in (g, q, out, lse))
        (kl, km, kr), (vl, vm, vr) = keys(k), keys(v)
        dqb = blocks(dq, width)
        gq, gk, gv = _flash_backward(gb, qb, kr, vr, ob, lb, 0.0, True, scale=scale)
        dqb += gq
        blocks(dk, width).add_(gk)
        blocks(dv, width).add_(gv)
        flipped = (t.flip(2) for t in (gb, qb))
        gq, gk, gv = _flash_backward(
            *flipped, kl, vl, ob.flip(2), lb.flip(2), 0.0, True, scale=scale
        )
        dqb += gq.flip(2)
        blocks(dk, 0).add_(gk.flip(2))
        blocks(dv, 0).add_(gv.flip(2))
        if km is not None:
            gq, gk, gv = _flash_backward(gb, qb, km, vm, ob, lb, 0.0, False, scale=scale)
            dqb += gq
            # middle column c of block i is key (i + 1) n + c: add back n columns at a time
            for c0 in range(0, width - n, n):
                c1 = min(c0 + n, width - n)
                blocks(dk, n + c0)[:, :, : c1 - c0] += gk[:, :, c0:c1]
                blocks(dv, n + c0)[:, :, : c1 - c0] += gv[:, :, c0:c1]
        dq, dk, dv = (t[:, :s].unflatten(0, (b, h)) for t in (dq, dk, dv))
        return dq, dk, dv, None, None, None
