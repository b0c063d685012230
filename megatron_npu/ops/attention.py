"""Fused (flash) attention: native torch path and the ``npu_fusion_attention`` binding.

Semantics shared by both paths (and by :func:`fused_attention`, which picks one at call time):

* ``input_layout`` is one of ``SBH``, ``BSH``, ``BSND``, ``BNSD``; the output has the layout of
  ``query``. ``H = head_num * D``; key/value may have fewer heads (grouped-query attention) as
  long as the query head count is a multiple of theirs; query head ``n`` reads key/value head
  ``n // (Nq // Nkv)``.
* ``attention_mask`` is bool or uint8, **True/1 means masked out**, shaped ``(B, N, Sq, Skv)``,
  ``(B, 1, Sq, Skv)``, ``(1, 1, Sq, Skv)`` or ``(Sq, Skv)``. With ``causal`` both apply (a key
  is visible where the mask and causality allow it); a mask that is exactly the causal one is
  recognised and dropped (see :func:`without_redundant_causal_mask`). No call compares a mask
  on the host per layer: the shared :func:`causal_mask` is recognised by identity, any other mask
  is classified once per tensor (cached while the tensor lives unmodified).
* Window: with ``offset = Skv - Sq`` (queries aligned to the *end* of the keys, bottom-right, as
  in torch_npu ``sparse_mode`` 3/4 and flash-attention), query ``i`` may attend key ``j`` iff
  ``-pre_tokens <= j - i - offset <= next_tokens``; ``causal=True`` additionally caps the upper
  bound at 0. Hence ``causal`` with ``pre_tokens=next_tokens=65536`` (anything >= the sequence)
  is full causal attention, and ``causal`` with ``pre_tokens=2048, next_tokens=0`` is a causal
  sliding window: each query sees itself and the 2048 keys before it.
* ``scale`` defaults to ``1/sqrt(D)``; ``dropout_p`` is the attention dropout (the kernel is
  passed ``keep_prob = 1 - dropout_p``; pass 0 when not training).
* A query row with no visible key outputs zeros (and gets zero gradient); the NPU binding then
  passes ``inner_precise=2``, the kernel's documented invalid-row mode.
* On CPU, fp16/bf16 inputs are computed in fp32 and the output rounded once.

The native path uses ``torch.nn.functional.scaled_dot_product_attention``. When the window is
narrow compared with the key length it runs query blocks that only see the keys inside their
window, so its cost grows with ``Sq * window`` instead of ``Sq * Skv``. On CPU (fp32 compute,
no user mask, no dropout) a window's forward is the C++ band kernel
(:mod:`megatron_npu.ops.cpu_band_kernel`) where it builds, else ATen flash-kernel pieces merged
by their log-sum-exp; the backward is always the flash pieces' (below).

The NPU binding maps the window to torch_npu ``sparse_mode`` (see :func:`npu_sparse_plan`).
"""

from __future__ import annotations

import math
import weakref
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron_npu.ops._common import check_float_dtype, check_same_dtype, dtype_name
from megatron_npu.ops.cpu_band_kernel import band_attention_forward
from megatron_npu.ops.kernels import npu_kernels

#: torch_npu's "no limit" value for pre_tockens / next_tockens.
MAX_TOKENS = 2147483647
LAYOUTS = ("SBH", "BSH", "BSND", "BNSD")
#: side of the compressed lower-triangle mask torch_npu wants for sparse_mode 2, 3 and 4.
COMPRESSED_MASK_SIZE = 2048
SPARSE_MODE_DEFAULT = 0
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
SPARSE_MODE_BAND = 4
#: ``inner_precise`` value that turns on the kernel's invalid-row (fully masked row) handling
INNER_PRECISE_INVALID_ROWS = 2

_OP = "fused_attention"


class AttentionShape(NamedTuple):
    batch: int
    heads: int
    kv_heads: int
    sq: int
    skv: int
    head_dim: int


class SparsePlan(NamedTuple):
    """Arguments the NPU binding passes to ``npu_fusion_attention`` for a given window."""

    sparse_mode: int
    atten_mask: torch.Tensor | None
    pre_tockens: int
    next_tockens: int


# --------------------------------------------------------------------------- validation


def attention_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    op: str = _OP,
) -> AttentionShape:
    """Validate q/k/v against ``input_layout`` and ``head_num``; return the logical sizes."""
    if input_layout not in LAYOUTS:
        raise ValueError(f"{op}: input_layout {input_layout!r} is not one of {', '.join(LAYOUTS)}")
    if not isinstance(head_num, int) or isinstance(head_num, bool) or head_num < 1:
        raise ValueError(f"{op}: head_num must be a positive int, got {head_num!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float_dtype(op, name, t)
    check_same_dtype(op, ("query", "key", "value"), (query, key, value))
    ndim = 3 if input_layout in ("SBH", "BSH") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != ndim:
            raise ValueError(
                f"{op}: input_layout {input_layout} needs {ndim}-D {name}, got shape "
                f"{tuple(t.shape)}"
            )
    if key.shape != value.shape:
        raise ValueError(
            f"{op}: key and value must have the same shape, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if input_layout in ("SBH", "BSH"):
        s_dim, b_dim = (0, 1) if input_layout == "SBH" else (1, 0)
        hidden = query.shape[2]
        if hidden % head_num:
            raise ValueError(
                f"{op}: head_num {head_num} must divide the query hidden size H={hidden}"
            )
        head_dim = hidden // head_num
        kv_hidden = key.shape[2]
        if kv_hidden % head_dim:
            raise ValueError(
                f"{op}: key hidden size {kv_hidden} is not a multiple of the head dim "
                f"D={head_dim} (H/head_num)"
            )
        kv_heads = kv_hidden // head_dim
    else:
        s_dim, n_dim = (1, 2) if input_layout == "BSND" else (2, 1)
        b_dim = 0
        if query.shape[n_dim] != head_num:
            raise ValueError(
                f"{op}: head_num {head_num} must equal the query N dim "
                f"{query.shape[n_dim]} for layout {input_layout}"
            )
        head_dim = query.shape[3]
        if key.shape[3] != head_dim:
            raise ValueError(
                f"{op}: key head dim {key.shape[3]} must equal the query head dim {head_dim}"
            )
        kv_heads = key.shape[n_dim]
    if kv_heads < 1 or head_num % kv_heads:
        raise ValueError(
            f"{op}: query heads {head_num} must be a multiple of key/value heads {kv_heads}"
        )
    batch = query.shape[b_dim]
    if key.shape[b_dim] != batch:
        raise ValueError(f"{op}: batch of key {key.shape[b_dim]} differs from query {batch}")
    sq, skv = query.shape[s_dim], key.shape[s_dim]
    if min(sq, skv, head_dim, batch) < 1:
        raise ValueError(f"{op}: empty dimension in query {tuple(query.shape)}")
    return AttentionShape(batch, head_num, kv_heads, sq, skv, head_dim)


def check_attention_mask(mask: torch.Tensor | None, shape: AttentionShape, op: str = _OP) -> None:
    """The mask must be bool/uint8 and shaped BNSS, B1SS, 11SS or SS."""
    if mask is None:
        return
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(
            f"{op}: attention_mask dtype must be bool or uint8 (True/1 = masked), "
            f"got {dtype_name(mask.dtype)}"
        )
    b, n, sq, skv = shape.batch, shape.heads, shape.sq, shape.skv
    allowed = {(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
    if tuple(mask.shape) not in allowed:
        raise ValueError(
            f"{op}: attention_mask shape {tuple(mask.shape)} is not one of BNSS "
            f"{(b, n, sq, skv)}, B1SS {(b, 1, sq, skv)}, 11SS {(1, 1, sq, skv)} or SS {(sq, skv)}"
        )


def window_bounds(
    sq: int, skv: int, causal: bool, pre_tokens: int, next_tokens: int, op: str = _OP
) -> tuple[int, int]:
    """Bounds ``(lo, hi)`` on ``d = j - i - (skv - sq)`` of the visible keys, clipped to the
    range ``d`` can take, so ``lo == -(skv - 1)`` / ``hi == sq - 1`` mean "no restriction"."""
    for name, v in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{op}: {name} must be an int, got {v!r}")
    hi = min(next_tokens, 0) if causal else next_tokens
    lo = -pre_tokens
    if lo > hi:
        raise ValueError(
            f"{op}: the window is empty: need -pre_tokens <= next_tokens"
            f"{' (capped at 0 by causal)' if causal else ''}, got pre_tokens={pre_tokens}, "
            f"next_tokens={next_tokens}"
        )
    return max(lo, -(skv - 1)), min(hi, sq - 1)


_causal_masks: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _causal_pair(sq: int, skv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(Sq, Skv)`` causal mask (True = masked, bottom-right aligned) and its
    ``(1, 1, Sq, Skv)`` view, built once per shape and device."""
    key = (sq, skv, torch.device(device))
    pair = _causal_masks.get(key)
    if pair is None:
        hidden = ~visible_keys(0, sq, 0, skv, skv - sq, -(skv - 1), 0, device)
        if len(_causal_masks) >= 8:  # one or two shapes per run in practice: keep it small
            _causal_masks.clear()
        pair = _causal_masks[key] = (hidden, hidden.view(1, 1, sq, skv))
        # "npu" and "npu:0" name the same mask once built: tensors report the indexed device
        _causal_masks.setdefault((sq, skv, hidden.device), pair)
    return pair


def causal_mask(
    sq: int, skv: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Megatron's plain causal attention mask, ``(1, 1, Sq, Skv)`` bool (True = masked), shared.

    A caller that knows its mask is the plain causal one (the training loop, whose data layer
    builds no document masks) passes this tensor: attention recognises it by identity, so no
    call compares it on the host. It must not be modified in place."""
    return _causal_pair(sq, sq if skv is None else skv, torch.device(device))[1]


#: ``id(mask)`` -> (weak reference, ``mask._version`` when classified, answers so far)
_mask_facts: dict[int, tuple[weakref.ref, int, dict[tuple, bool]]] = {}
_MASK_FACTS_LIMIT = 16


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _mask_facts.get(key)
    if entry is not None and entry[0] is ref:
        del _mask_facts[key]


def mask_fact(mask: torch.Tensor, question: tuple, answer) -> bool:  # noqa: ANN001
    """``answer()`` (a host-side bool about ``mask``, which costs a device-to-host sync) asked
    once per mask tensor: cached under ``question`` while the tensor lives and is not modified
    in place (its version counter is unchanged), so the layers of a step share one answer."""
    key = id(mask)
    entry = _mask_facts.get(key)
    if entry is None or entry[0]() is not mask or entry[1] != mask._version:
        if len(_mask_facts) >= _MASK_FACTS_LIMIT:
            _mask_facts.clear()
        ref = weakref.ref(mask, lambda r, k=key: _forget(k, r))
        entry = _mask_facts[key] = (ref, mask._version, {})
    facts = entry[2]
    if question not in facts:
        facts[question] = bool(answer())
    return facts[question]


def without_redundant_causal_mask(
    mask: torch.Tensor | None, shape: AttentionShape, causal: bool
) -> torch.Tensor | None:
    """``mask``, or None when ``causal`` already hides exactly what it hides.

    Causal attention applies a supplied mask *as well* (a key is visible only where both allow
    it), so a document mask (``--reset-attention-mask``) is honoured. Megatron's data loader
    hands every causal run its plain causal mask; recognising it keeps the unmasked kernels.
    The shared :func:`causal_mask` is recognised by identity (no comparison); any other mask is
    compared once per tensor (:func:`mask_fact`), not once per layer."""
    if mask is None or not causal:
        return mask
    sq, skv = shape.sq, shape.skv
    hidden, shared = _causal_pair(sq, skv, mask.device)
    if mask is shared or mask is hidden:
        return None
    same = mask_fact(
        mask,
        ("causal", sq, skv),
        lambda: (mask.reshape(-1, sq, skv).bool() == hidden).all(),
    )
    return None if same else mask


def check_dropout(dropout_p: float, op: str = _OP) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(
            f"{op}: dropout_p must be in [0, 1) (keep_prob in (0, 1]), got {dropout_p}"
        )


def visible_keys(
    q_start: int, q_end: int, k_start: int, k_end: int, offset: int, lo: int, hi: int, device
) -> torch.Tensor:
    """Bool ``(q_end-q_start, k_end-k_start)``: True where the query may attend the key."""
    i = torch.arange(q_start, q_end, device=device).unsqueeze(1)
    j = torch.arange(k_start, k_end, device=device).unsqueeze(0)
    d = j - i - offset
    return (d >= lo) & (d <= hi)


# --------------------------------------------------------------------------- layouts


def to_bnsd(x: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = x.shape  # SBH
    return x.view(s, b, heads, h // heads).permute(1, 2, 0, 3)


def from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.transpose(1, 2).contiguous()
    if layout == "BSH":
        return x.transpose(1, 2).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


# --------------------------------------------------------------------------- native path


def _block_size(band_width: int) -> int:
    """Query block for the windowed path: big enough to amortise per-call overhead, small
    enough that the keys a block sees stay close to the window."""
    return max(64, min(512, band_width))


def _sdpa(q, k, v, visible, scale, dropout_p, gqa) -> torch.Tensor:
    """SDPA where ``visible`` (True = attend) may leave whole rows empty: those output 0."""
    if visible is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    # no host-side "are there empty rows?": open them for SDPA and zero their output anyway
    empty = ~visible.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible | empty, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return out.masked_fill(empty, 0.0)


def native_fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    head_num: int,
    input_layout: str = "SBH",
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    pre_tokens: int = MAX_TOKENS,
    next_tokens: int = MAX_TOKENS,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Device-neutral fused attention on ``scaled_dot_product_attention`` (module docstring)."""
    shape = attention_shape(query, key, value, head_num, input_layout)
    check_attention_mask(attention_mask, shape)
    check_dropout(dropout_p)
    attention_mask = without_redundant_causal_mask(attention_mask, shape, causal)
    sq, skv = shape.sq, shape.skv
    lo, hi = window_bounds(sq, skv, causal, pre_tokens, next_tokens)
    offset = skv - sq
    if scale is None:
        scale = 1.0 / math.sqrt(shape.head_dim)
    gqa = shape.kv_heads != shape.heads
    q = to_bnsd(query, shape.heads, input_layout)
    k = to_bnsd(key, shape.kv_heads, input_layout)
    v = to_bnsd(value, shape.kv_heads, input_layout)
    if query.device.type == "cpu":
        if query.dtype != torch.float32:
            # CPU has no fast 16-bit attention, and its 16-bit backward (which reuses the
            # rounded output) misses the fp16/bf16 accuracy rule on small gradients: compute in
            # fp32 and round the output once. GPUs keep their 16-bit kernels.
            q, k, v = q.float(), k.float(), v.float()
        if gqa:  # SDPA's enable_gqa backward is slow on CPU: share the K/V heads explicitly
            group = shape.heads // shape.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            gqa = False
    user_visible = None if attention_mask is None else attention_mask == 0
    left_bites, right_bites = lo > -(skv - 1), hi < sq - 1

    if user_visible is None and not left_bites and not right_bites:
        out = _sdpa(q, k, v, None, scale, dropout_p, gqa)
    elif user_visible is None and not left_bites and hi == 0 and sq == skv:
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    elif (
        user_visible is None
        and dropout_p == 0.0
        and (block := _batched_band_block(q, sq, skv, lo, hi))
    ):
        out = _BatchedBandAttention.apply(q, k, v, -lo, block, scale)
    elif user_visible is None and dropout_p == 0.0 and (plan := _band_plan(q, sq, skv, lo, hi)):
        out = _BandAttention.apply(q, k, v, plan, (offset + lo, offset + hi), scale)
    else:
        band_width = hi - lo + 1
        block = _block_size(band_width)
        if band_width + block >= skv:  # the window covers (almost) everything: one call
            visible = visible_keys(0, sq, 0, skv, offset, lo, hi, q.device)
            if user_visible is not None:
                visible = visible & user_visible
            out = _sdpa(q, k, v, visible, scale, dropout_p, gqa)
        else:
            out = _windowed(q, k, v, user_visible, offset, lo, hi, block, scale, dropout_p, gqa)
    return from_bnsd(out.to(query.dtype), input_layout)


def _windowed(q, k, v, user_visible, offset, lo, hi, block, scale, dropout_p, gqa):
    """Query blocks that only look at the keys inside their window."""
    sq, skv = q.shape[2], k.shape[2]
    outs = []
    cache: dict[tuple[int, int, int], torch.Tensor] = {}
    for q0 in range(0, sq, block):
        q1 = min(sq, q0 + block)
        k0 = max(0, q0 + offset + lo)
        k1 = min(skv, q1 - 1 + offset + hi + 1)
        if k1 <= k0:  # no query of this block sees any key
            outs.append(q.new_zeros(q.shape[0], q.shape[1], q1 - q0, v.shape[3]))
            continue
        # the band pattern only depends on where the block sits relative to its keys
        sig = (q1 - q0, k1 - k0, q0 + offset - k0)
        visible = cache.get(sig)
        if visible is None:
            visible = visible_keys(q0, q1, k0, k1, offset, lo, hi, q.device)
            cache[sig] = visible
        if user_visible is not None:
            visible = visible & user_visible[..., q0:q1, k0:k1]
        outs.append(
            _sdpa(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], visible, scale, dropout_p, gqa)
        )
    return torch.cat(outs, dim=2)


# --------------------------------------------------------------------------- band path (CPU)
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


def _band_plan(q: torch.Tensor, sq: int, skv: int, lo: int, hi: int):
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


class _BandAttention(torch.autograd.Function):
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


# --------------------------------------------------------------------------- batched band path
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


def _batched_band_block(q: torch.Tensor, sq: int, skv: int, lo: int, hi: int) -> int:
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


class _BatchedBandAttention(torch.autograd.Function):
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
        q, k, v = (_BatchedBandAttention._rows(t, length) for t in (q, k, v))
        ctx.layout, ctx.scale = (b, h, s, width, n, nb), scale
        kernel = band_attention_forward(q, k, v, -width, 0, scale)
        if kernel is not None:  # the C++ forward computes the same output and log-sum-exp
            out, lse = kernel
            ctx.save_for_backward(q, k, v, out, lse)
            return out[:, :s].unflatten(0, (b, h))
        blocks, keys = _BatchedBandAttention._layout(width, n, nb)
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
        g = _BatchedBandAttention._rows(grad_out, q.shape[1])
        blocks, keys = _BatchedBandAttention._layout(width, n, nb)
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


# --------------------------------------------------------------------------- NPU binding

_compressed_masks: dict[torch.device, torch.Tensor] = {}


def compressed_causal_mask(device: torch.device | str) -> torch.Tensor:
    """The 2048x2048 bool upper triangle (diagonal excluded, True = masked) that torch_npu
    requires as ``atten_mask`` for sparse_mode 2, 3 and 4. Cached per device."""
    device = torch.device(device)
    mask = _compressed_masks.get(device)
    if mask is None:
        n = COMPRESSED_MASK_SIZE
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu_(diagonal=1)
        _compressed_masks[device] = mask
    return mask


def npu_sparse_plan(
    sq: int,
    skv: int,
    *,
    causal: bool,
    pre_tokens: int,
    next_tokens: int,
    attention_mask: torch.Tensor | None,
    device: torch.device | str,
) -> SparsePlan:
    """Map (causal, window, mask) to torch_npu ``sparse_mode``/``atten_mask``/pre/next.

    With ``lo, hi`` the bounds from :func:`window_bounds` (bottom-right aligned):

    * no mask, no restriction -> ``sparse_mode=0``, ``atten_mask=None`` (full attention; the
      kernel ignores pre/next without a mask).
    * no mask, ``hi == 0`` and no left restriction (causal, or next=0 with a window at least
      the sequence long, e.g. pre=next=65536 + causal) -> ``sparse_mode=3`` (rightDownCausal)
      with the compressed 2048x2048 mask; pre/next passed as MAX/0 (ignored by mode 3).
    * no mask, any other window (e.g. pre=2048, next=0, causal) -> ``sparse_mode=4`` (band,
      bottom-right origin) with the compressed mask, ``pre_tockens=pre_tokens`` and
      ``next_tockens=hi`` (``min(next_tokens, 0)`` under causal).
    * explicit mask -> ``sparse_mode=0`` with the mask OR-ed with the window (so the mask
      carries everything); pre/next are the same window in mode 0's top-left coordinates
      (``pre - offset``, ``hi + offset``) when both are >= 0, else MAX/MAX (no block skipping,
      still exact because the mask holds the window).
    """
    lo, hi = window_bounds(sq, skv, causal, pre_tokens, next_tokens)
    offset = skv - sq
    left_bites, right_bites = lo > -(skv - 1), hi < sq - 1
    if attention_mask is None:
        if not left_bites and not right_bites:
            return SparsePlan(SPARSE_MODE_DEFAULT, None, MAX_TOKENS, MAX_TOKENS)
        compressed = compressed_causal_mask(device)
        if not left_bites and hi == 0:
            return SparsePlan(SPARSE_MODE_RIGHT_DOWN_CAUSAL, compressed, MAX_TOKENS, 0)
        pre = min(pre_tokens, MAX_TOKENS)
        nxt = max(min(hi, MAX_TOKENS), -MAX_TOKENS)
        return SparsePlan(SPARSE_MODE_BAND, compressed, pre, nxt)
    masked = attention_mask.bool()
    if left_bites or right_bites:
        hidden = ~visible_keys(0, sq, 0, skv, offset, lo, hi, masked.device)
        masked = masked | hidden
    pre_tl = min(pre_tokens - offset, MAX_TOKENS) if left_bites else MAX_TOKENS
    next_tl = min(hi + offset, MAX_TOKENS) if right_bites else MAX_TOKENS
    if pre_tl < 0 or next_tl < 0:
        pre_tl = next_tl = MAX_TOKENS
    return SparsePlan(SPARSE_MODE_DEFAULT, masked, pre_tl, next_tl)


def npu_fused_attention(
    kernels: ModuleType,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    head_num: int,
    input_layout: str = "SBH",
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    pre_tokens: int = MAX_TOKENS,
    next_tokens: int = MAX_TOKENS,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Fused attention through ``kernels.npu_fusion_attention`` (torch_npu or its emulation)."""
    shape = attention_shape(query, key, value, head_num, input_layout)
    check_attention_mask(attention_mask, shape)
    check_dropout(dropout_p)
    attention_mask = without_redundant_causal_mask(attention_mask, shape, causal)
    plan = npu_sparse_plan(
        shape.sq,
        shape.skv,
        causal=causal,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        attention_mask=attention_mask,
        device=query.device,
    )
    if scale is None:  # the kernel's own default is 1.0, not 1/sqrt(D)
        scale = 1.0 / math.sqrt(shape.head_dim)
    # A fully masked query row ("invalid row") is computed correctly (output 0) only with
    # inner_precise=2 under an explicit mask; the kernel finds such rows itself in modes 2-4.
    # Only a supplied mask can hide a whole row in mode 0; asked once per mask (:func:`mask_fact`).
    dead_rows = (
        attention_mask is not None
        and plan.sparse_mode == SPARSE_MODE_DEFAULT
        and mask_fact(
            attention_mask,
            ("dead-rows", shape.sq, shape.skv, pre_tokens, next_tokens, causal),
            lambda: plan.atten_mask.bool().all(dim=-1).any(),
        )
    )
    outputs = kernels.npu_fusion_attention(
        query,
        key,
        value,
        head_num,
        input_layout,
        atten_mask=plan.atten_mask,
        scale=scale,
        keep_prob=1.0 - dropout_p,
        pre_tockens=plan.pre_tockens,
        next_tockens=plan.next_tockens,
        sparse_mode=plan.sparse_mode,
        inner_precise=INNER_PRECISE_INVALID_ROWS if dead_rows else 0,
    )
    return outputs[0]


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    head_num: int,
    input_layout: str = "SBH",
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    pre_tokens: int = MAX_TOKENS,
    next_tokens: int = MAX_TOKENS,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Fused attention on the NPU kernel module in use, else the native path."""
    kwargs = dict(
        head_num=head_num,
        input_layout=input_layout,
        causal=causal,
        attention_mask=attention_mask,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        scale=scale,
        dropout_p=dropout_p,
    )
    kernels = npu_kernels("npu_fusion_attention", "npu_fusion_attention_grad")
    if kernels is not None:
        return npu_fused_attention(kernels, query, key, value, **kwargs)
    return native_fused_attention(query, key, value, **kwargs)
