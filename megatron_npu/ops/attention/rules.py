"""The semantics every fused-attention path shares: shapes and layouts, masks, the window's
bounds, dropout (see :mod:`megatron_npu.ops.attention`)."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from megatron_npu.ops._common import check_float_dtype, check_same_dtype, dtype_name

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


def checked_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    attention_mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
) -> tuple[AttentionShape, torch.Tensor | None]:
    """What every path checks first: the shape, the mask and the dropout; returns the shape and
    the mask less a redundant causal one (:func:`without_redundant_causal_mask`)."""
    shape = attention_shape(query, key, value, head_num, input_layout)
    check_attention_mask(attention_mask, shape)
    check_dropout(dropout_p)
    return shape, without_redundant_causal_mask(attention_mask, shape, causal)


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
