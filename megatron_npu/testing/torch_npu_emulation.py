"""Pure-torch EMULATION of the torch_npu fused ops that megatron_npu calls.

This is not torch_npu and runs no Ascend kernel. It reproduces, on any torch device, the call
contract of each torch_npu function the op layer uses: the same name, parameter names and
defaults (op-plugin schemas, including the ``pre_tockens``/``next_tockens`` spelling), the same
return tuples (e.g. ``npu_fusion_attention`` returns ``(out, softmax_max, softmax_sum, reserved,
seed, offset, numels)`` with fp32 softmax statistics shaped ``(B, N, Sq, 8)``), and the input
checks the kernel documentation states. Errors name the broken constraint.

Every call is first bound against the real kernel's schema (torch_npu's own codegen yaml of the
pinned release, :mod:`megatron_npu.devices.torch_npu_schema`), so a call the real binding would
reject fails here as well, and each function's signature is that schema's Python form.

The adaptor binds it as its kernel module (``megatron_npu.ops.kernels.use_npu_kernels``) on the
``npu-emulated`` device; it is never registered as ``torch_npu``, so nothing can mistake it for an
installed torch_npu.

Results produced through it are labelled ``npu-emulated``, never ``npu``: they say the NPU code
path (argument mapping, mask conventions, sparse modes, layouts) is right, not that an Ascend
device computes the same numbers.

The maths here is written independently of ``megatron_npu.ops`` (explicit score matrices and
masks built from the ``sparse_mode`` rules, fp32 internal compute for fp16/bf16), so comparing
the native op path with this one is a real check.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_npu.devices import torch_npu_schema
from megatron_npu.devices.facts import NPU_EMULATED

IS_EMULATION = True
#: the device label results obtained through this module must carry
DEVICE_LABEL = NPU_EMULATED

__all__ = [
    "DEVICE_LABEL",
    "IS_EMULATION",
    "count_kernel_calls",
    "record_call_sites",
    "npu_apply_adam_w",
    "npu_fast_gelu",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_gelu",
    "npu_grouped_matmul",
    "npu_moe_gating_top_k",
    "npu_moe_gating_top_k_backward",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute_with_routing_map",
    "npu_ring_attention_update",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_scaled_masked_softmax",
    "npu_swiglu",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MAX = 2147483647
_COMPRESSED = 2048


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _float_dtype(op: str, arg: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {arg} dtype {_name(t.dtype)} is not float16, bfloat16 or float32")


# ============================================================================ attention

_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _split_heads(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    """-> (B, N, S, D)"""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        return x.unflatten(2, (n, -1)).permute(0, 2, 1, 3)
    return x.unflatten(2, (n, -1)).permute(1, 2, 0, 3)  # SBH


def _merge_heads(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).flatten(2)
    return x.permute(2, 0, 1, 3).flatten(2)  # SBH


def _fa_dims(query, key, value, head_num, layout):
    op = "npu_fusion_attention"
    if layout not in _LAYOUTS:
        raise ValueError(f"{op}: input_layout {layout!r} is not one of {', '.join(_LAYOUTS)}")
    if layout == "TND":
        raise NotImplementedError(f"{op}: input_layout 'TND' (varlen) is not emulated")
    for arg, t in (("query", query), ("key", key), ("value", value)):
        _float_dtype(op, arg, t)
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"{op}: query, key and value must have the same dtype, got {_name(query.dtype)}, "
            f"{_name(key.dtype)}, {_name(value.dtype)}"
        )
    rank = 3 if layout in ("BSH", "SBH") else 4
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise ValueError(f"{op}: layout {layout} needs {rank}-D {arg}, got {tuple(t.shape)}")
    if tuple(key.shape) != tuple(value.shape):
        raise ValueError(
            f"{op}: key and value shapes must be equal, got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if head_num < 1:
        raise ValueError(f"{op}: head_num must be >= 1, got {head_num}")
    if rank == 3:
        h = query.shape[-1]
        if h % head_num != 0:
            raise ValueError(f"{op}: head_num {head_num} does not divide H={h}")
        d = h // head_num
        if key.shape[-1] % d != 0:
            raise ValueError(f"{op}: key H={key.shape[-1]} is not a multiple of D={d}")
        n_kv = key.shape[-1] // d
        b, sq, skv = (
            (query.shape[0], query.shape[1], key.shape[1])
            if layout == "BSH"
            else (query.shape[1], query.shape[0], key.shape[0])
        )
        b_kv = key.shape[0] if layout == "BSH" else key.shape[1]
    else:
        n_axis, s_axis = (1, 2) if layout == "BNSD" else (2, 1)
        if query.shape[n_axis] != head_num:
            raise ValueError(
                f"{op}: head_num {head_num} differs from query N {query.shape[n_axis]} ({layout})"
            )
        d = query.shape[3]
        if key.shape[3] != d:
            raise ValueError(f"{op}: Dq={d} must equal Dk={key.shape[3]}")
        n_kv = key.shape[n_axis]
        b, sq, skv = query.shape[0], query.shape[s_axis], key.shape[s_axis]
        b_kv = key.shape[0]
    if b_kv != b:
        raise ValueError(f"{op}: query batch {b} and key batch {b_kv} differ")
    if not 1 <= d <= 768:
        raise ValueError(f"{op}: head dim D={d} is outside 1..768")
    if not 1 <= head_num <= 256:
        raise ValueError(f"{op}: query head count N={head_num} is outside 1..256")
    if n_kv < 1 or head_num % n_kv != 0:
        raise ValueError(
            f"{op}: Nq/Nkv must be a non-zero integer (GQA), got Nq={head_num}, Nkv={n_kv}"
        )
    return b, n_kv, sq, skv, d


def _fa_visible(atten_mask, sparse_mode, pre, nxt, b, n, sq, skv, device):
    """Bool tensor broadcastable to (B, N, Sq, Skv): True = the score takes part."""
    op = "npu_fusion_attention"
    if sparse_mode not in range(9):
        raise ValueError(f"{op}: sparse_mode must be in 0..8, got {sparse_mode}")
    if sparse_mode in (5, 6, 7, 8):
        raise NotImplementedError(
            f"{op}: sparse_mode {sparse_mode} (prefix/varlen) is not emulated"
        )
    if atten_mask is None:
        # documented: without atten_mask, sparse_mode/pre_tockens/next_tockens do not apply
        return None
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(
            f"{op}: atten_mask dtype must be bool or uint8, got {_name(atten_mask.dtype)}"
        )
    row = torch.arange(sq, device=device).view(sq, 1)
    col = torch.arange(skv, device=device).view(1, skv)
    if sparse_mode in (2, 3, 4):
        if tuple(atten_mask.shape) != (_COMPRESSED, _COMPRESSED):
            raise ValueError(
                f"{op}: sparse_mode {sparse_mode} needs the compressed atten_mask of "
                f"shape (2048, 2048), got {tuple(atten_mask.shape)}"
            )
        expected = torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device)
        if not torch.equal(atten_mask.bool(), torch.triu(expected, diagonal=1)):
            raise ValueError(
                f"{op}: sparse_mode {sparse_mode} needs the compressed atten_mask "
                "triu(ones(2048, 2048), diagonal=1) (True above the diagonal)"
            )
        if sparse_mode == 2:  # leftUpCausal: origin top-left
            return col <= row
        shift = skv - sq  # rightDownCausal / band: origin bottom-right
        if sparse_mode == 3:
            return col <= row + shift
        if pre + nxt < 0:
            raise ValueError(
                f"{op}: sparse_mode 4 (band) needs pre_tockens + next_tockens >= 0, "
                f"got {pre} and {nxt}"
            )
        return (col - row - shift <= nxt) & (row + shift - col <= pre)
    shapes = {(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
    if tuple(atten_mask.shape) not in shapes:
        raise ValueError(
            f"{op}: atten_mask shape {tuple(atten_mask.shape)} must be BNSS, B1SS, "
            f"11SS or SS with B={b}, N={n}, Sq={sq}, Skv={skv}"
        )
    keep = atten_mask == 0
    if sparse_mode == 1:  # allMask: the mask alone
        return keep
    # sparse_mode 0: the mask plus the pre/next band, origin top-left
    if nxt < 0 and (pre < -nxt or -nxt >= skv):
        raise ValueError(
            f"{op}: negative next_tockens={nxt} needs pre_tockens >= |next_tockens| "
            f"and |next_tockens| < Skv={skv}"
        )
    if pre < 0 and (nxt < -pre or -pre >= sq):
        raise ValueError(
            f"{op}: negative pre_tockens={pre} needs next_tockens >= |pre_tockens| "
            f"and |pre_tockens| < Sq={sq}"
        )
    band = (col - row <= nxt) & (row - col <= pre)
    return keep & band


def _fa_check_dead_rows(dead: torch.Tensor, sparse_mode: int, inner_precise: int) -> None:
    """Fully masked query rows ("invalid rows") output 0 only where the docs promise it:
    ``inner_precise=2`` enables invalid-row computation, and the kernel enables it by itself
    where the sparse mode lets it find such rows (the causal / band modes 2, 3 and 4, e.g.
    mode 3 with Sq > Skv). A fully masked row of an explicit mask under modes 0/1 with
    ``inner_precise`` 0 or 1 is documented to lose accuracy, so the emulation refuses it."""
    if sparse_mode in (2, 3, 4) or inner_precise == 2 or not bool(dead.any()):
        return
    rows = int(dead.sum())
    raise ValueError(
        f"npu_fusion_attention: {rows} query row(s) are fully masked under sparse_mode "
        f"{sparse_mode} with inner_precise={inner_precise}; the kernel computes such invalid "
        "rows correctly only with inner_precise=2 (or sparse_mode 2/3/4)"
    )


def _fa_scores(query, key, value, head_num, layout, n_kv, atten_mask, sparse_mode, pre, nxt, scale):
    """(q, k, v) as fp32 (B, N, S, D) with the key/value heads shared out to the query heads,
    the scaled scores with hidden positions at -inf, and the visibility mask (or None)."""
    q = _split_heads(query, layout, head_num).float()
    k = _split_heads(key, layout, n_kv).float()
    v = _split_heads(value, layout, n_kv).float()
    b, sq, skv = q.shape[0], q.shape[2], k.shape[2]
    visible = _fa_visible(atten_mask, sparse_mode, pre, nxt, b, head_num, sq, skv, query.device)
    group = head_num // n_kv
    if group > 1:  # query head h reads key/value head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bnqd,bnkd->bnqk", q, k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return q, k, v, scores, visible


def _fa_keep(probs: torch.Tensor, seed: int, keep_prob: float) -> torch.Tensor:
    """The dropout keep-mask the forward drew from ``seed`` (the grad redraws it)."""
    gen = torch.Generator(device=probs.device).manual_seed(seed)
    return torch.rand(probs.shape, generator=gen, device=probs.device) < keep_prob


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
    sink=None,
    dropout_mask=None,
    seed=0,
    offset=0,
):
    """Emulates ``torch_npu.npu_fusion_attention``.

    Masks follow the kernel's modes: 0 = atten_mask plus the pre/next band with a top-left
    origin; 1 = atten_mask alone; 2 = leftUpCausal; 3 = rightDownCausal; 4 = band with a
    bottom-right origin. Modes 2-4 require the compressed 2048x2048 upper-triangle mask. Without
    ``atten_mask`` the whole score matrix is used. Rows left without any visible key output 0.
    """
    op = "npu_fusion_attention"
    b, n_kv, sq, skv, d = _fa_dims(query, key, value, head_num, input_layout)
    if pse is not None:
        raise NotImplementedError(f"{op}: pse is not emulated")
    if padding_mask is not None:
        raise ValueError(f"{op}: padding_mask is not supported by the kernel (must be None)")
    if prefix is not None or actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise NotImplementedError(f"{op}: prefix/actual_seq_qlen/actual_seq_kvlen are not emulated")
    if softmax_layout or sink is not None or dropout_mask is not None or seed or offset:
        raise NotImplementedError(
            f"{op}: softmax_layout/sink/dropout_mask/seed/offset are not "
            "emulated (their defaults only)"
        )
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"{op}: keep_prob must be in (0, 1], got {keep_prob}")
    if inner_precise not in (0, 1, 2):
        raise ValueError(f"{op}: inner_precise must be 0, 1 or 2, got {inner_precise}")
    q, k, v, scores, _ = _fa_scores(
        query,
        key,
        value,
        head_num,
        input_layout,
        n_kv,
        atten_mask,
        sparse_mode,
        pre_tockens,
        next_tockens,
        scale,
    )
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # a shift softmax is invariant to
    dead = torch.isneginf(row_max)  # rows with nothing to attend
    _fa_check_dead_rows(dead, sparse_mode, inner_precise)
    row_max = torch.where(dead, torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(dead, torch.ones_like(row_sum), row_sum)

    seed, offset, numels = 0, 0, 0
    if keep_prob < 1.0:
        seed = int(torch.randint(0, _MAX, (1,)).item())
        probs = probs * _fa_keep(probs, seed, keep_prob) / keep_prob
        numels = probs.numel()
    out = torch.einsum("bnqk,bnkd->bnqd", probs, v).to(query.dtype)
    softmax_max = row_max.detach().expand(-1, -1, -1, 8).contiguous()
    softmax_sum = row_sum.detach().expand(-1, -1, -1, 8).contiguous()
    reserved = torch.empty(0, dtype=query.dtype, device=query.device)
    return _merge_heads(out, input_layout), softmax_max, softmax_sum, reserved, seed, offset, numels


def npu_fusion_attention_grad(
    query,
    key,
    value,
    dy,
    head_num,
    input_layout,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    softmax_max=None,
    softmax_sum=None,
    softmax_in=None,
    attention_in=None,
    scale_value=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    seed=0,
    offset=0,
    numels=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
    sink=None,
):
    """Emulates ``torch_npu.npu_fusion_attention_grad``: ``(dq, dk, dv, dpse, dsink)`` of the
    forward that produced ``attention_in`` with statistics ``softmax_max`` / ``softmax_sum``
    (``(B, N, Sq, 8)`` fp32). The probabilities are rebuilt from *those* statistics, not from the
    scores' own maximum and sum, so outputs and statistics merged across several calls (ring
    attention) give each call's share of the merged gradient. Dropout redraws the forward's mask
    from ``seed``. Grouped-query key/value gradients are summed over their query heads."""
    op = "npu_fusion_attention_grad"
    b, n_kv, sq, skv, d = _fa_dims(query, key, value, head_num, input_layout)
    if pse is not None or padding_mask is not None or softmax_in is not None:
        raise NotImplementedError(f"{op}: pse/padding_mask/softmax_in are not emulated")
    if prefix is not None or actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise NotImplementedError(f"{op}: prefix/actual_seq_qlen/actual_seq_kvlen are not emulated")
    if softmax_layout or sink is not None:
        raise NotImplementedError(f"{op}: softmax_layout/sink are not emulated")
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise ValueError(
            f"{op}: softmax_max, softmax_sum and attention_in (the forward's outputs) are required"
        )
    for arg, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if t.dtype != torch.float32 or tuple(t.shape) != (b, head_num, sq, 8):
            raise ValueError(
                f"{op}: {arg} must be float32 of shape {(b, head_num, sq, 8)}, got "
                f"{_name(t.dtype)} {tuple(t.shape)}"
            )
    for arg, t in (("dy", dy), ("attention_in", attention_in)):
        if tuple(t.shape) != tuple(query.shape) or t.dtype != query.dtype:
            raise ValueError(
                f"{op}: {arg} must have query's shape {tuple(query.shape)} and "
                f"dtype {_name(query.dtype)}, got {_name(t.dtype)} "
                f"{tuple(t.shape)}"
            )
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"{op}: keep_prob must be in (0, 1], got {keep_prob}")
    q, k, v, scores, visible = _fa_scores(
        query,
        key,
        value,
        head_num,
        input_layout,
        n_kv,
        atten_mask,
        sparse_mode,
        pre_tockens,
        next_tockens,
        scale_value,
    )
    row_max, row_sum = softmax_max[..., :1], softmax_sum[..., :1]
    probs = torch.exp(scores - row_max) / torch.where(row_sum > 0, row_sum, 1.0)
    if visible is not None:
        probs = probs.masked_fill(~visible, 0.0)
    keep = _fa_keep(probs, seed, keep_prob) / keep_prob if keep_prob < 1.0 else 1.0
    g = _split_heads(dy, input_layout, head_num).float()
    out = _split_heads(attention_in, input_layout, head_num).float()
    dv = torch.einsum("bnqk,bnqd->bnkd", probs * keep, g)
    dprobs = torch.einsum("bnqd,bnkd->bnqk", g, v) * keep
    delta = (g * out).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale_value
    dq = torch.einsum("bnqk,bnkd->bnqd", dscores, k)
    dk = torch.einsum("bnqk,bnqd->bnkd", dscores, q)
    group = head_num // n_kv
    if group > 1:
        dk = dk.unflatten(1, (n_kv, group)).sum(2)
        dv = dv.unflatten(1, (n_kv, group)).sum(2)
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return (
        _merge_heads(dq.to(query.dtype), input_layout),
        _merge_heads(dk.to(key.dtype), input_layout),
        _merge_heads(dv.to(value.dtype), input_layout),
        empty,
        empty,
    )


def npu_ring_attention_update(
    prev_attn_out,
    prev_softmax_max,
    prev_softmax_sum,
    cur_attn_out,
    cur_softmax_max,
    cur_softmax_sum,
    *,
    actual_seq_qlen=None,
    input_layout="SBH",
    input_softmax_layout="",
):
    """Emulates ``torch_npu.npu_ring_attention_update``: merge two partial attentions over
    disjoint keys by their softmax statistics. ``m = max(m1, m2)``, ``l = l1 e^(m1 - m) +
    l2 e^(m2 - m)``, ``out = (o1 l1 e^(m1 - m) + o2 l2 e^(m2 - m)) / l``; outputs ``(S, B, H)``
    (``SBH``; ``TND`` is not emulated), statistics fp32 ``(B, N, S, 8)``. Returns ``(out,
    softmax_max, softmax_sum)``, ``out`` in the input dtype."""
    op = "npu_ring_attention_update"
    if input_layout != "SBH" or input_softmax_layout or actual_seq_qlen is not None:
        raise NotImplementedError(
            f"{op}: only input_layout 'SBH' with the default softmax layout is emulated"
        )
    for arg, t in (("prev_attn_out", prev_attn_out), ("cur_attn_out", cur_attn_out)):
        _float_dtype(op, arg, t)
        if t.dim() != 3:
            raise ValueError(f"{op}: {arg} must be (S, B, H), got {tuple(t.shape)}")
    if prev_attn_out.shape != cur_attn_out.shape or prev_attn_out.dtype != cur_attn_out.dtype:
        raise ValueError(f"{op}: prev_attn_out and cur_attn_out must share shape and dtype")
    s, b, h = prev_attn_out.shape
    stats = (
        ("prev_softmax_max", prev_softmax_max),
        ("prev_softmax_sum", prev_softmax_sum),
        ("cur_softmax_max", cur_softmax_max),
        ("cur_softmax_sum", cur_softmax_sum),
    )
    n = prev_softmax_max.shape[1] if prev_softmax_max.dim() == 4 else 0
    for arg, t in stats:
        if t.dtype != torch.float32 or t.dim() != 4 or tuple(t.shape) != (b, n, s, 8):
            raise ValueError(
                f"{op}: {arg} must be float32 (B, N, S, 8) = {(b, n, s, 8)}, got "
                f"{_name(t.dtype)} {tuple(t.shape)}"
            )
    if n < 1 or h % n:
        raise ValueError(f"{op}: N={n} heads do not divide H={h}")
    smax = torch.maximum(prev_softmax_max, cur_softmax_max)
    prev_scaled = prev_softmax_sum * torch.exp(prev_softmax_max - smax)
    cur_scaled = cur_softmax_sum * torch.exp(cur_softmax_max - smax)
    ssum = prev_scaled + cur_scaled

    def per_head(weight):  # (B, N, S, 8) -> (S, B, N, 1)
        return weight[..., :1].permute(2, 0, 1, 3)

    o1 = prev_attn_out.float().unflatten(2, (n, h // n))
    o2 = cur_attn_out.float().unflatten(2, (n, h // n))
    out = (o1 * per_head(prev_scaled) + o2 * per_head(cur_scaled)) / per_head(ssum)
    return out.flatten(2).to(prev_attn_out.dtype), smax, ssum


# ============================================================================ norms


def npu_rms_norm(input, gamma, epsilon=1e-6):  # noqa: A002 - torch_npu's parameter name
    """Emulates ``torch_npu.npu_rms_norm``: ``(x / sqrt(mean(x^2) + eps) * gamma, rstd)`` with
    the mean over gamma's trailing dims; rstd is fp32 with those dims kept as 1."""
    op = "npu_rms_norm"
    x = input
    _float_dtype(op, "x", x)
    _float_dtype(op, "gamma", gamma)
    if gamma.dtype not in (x.dtype, torch.float32):
        raise TypeError(
            f"{op}: gamma dtype {_name(gamma.dtype)} must equal x dtype "
            f"{_name(x.dtype)} (documented rule) or be float32 (the kernel's "
            "mixed-precision form for float16/bfloat16 x)"
        )
    if not 2 <= x.dim() <= 8:
        raise ValueError(f"{op}: x must have 2 to 8 dims, got {x.dim()}")
    k = gamma.dim()
    if k < 1 or k > x.dim() or tuple(x.shape[x.dim() - k :]) != tuple(gamma.shape):
        raise ValueError(
            f"{op}: gamma shape {tuple(gamma.shape)} must equal the trailing dims of "
            f"x {tuple(x.shape)}"
        )
    if epsilon < 0:
        raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon}")
    dims = tuple(range(x.dim() - k, x.dim()))
    xf = x.float()
    rms = torch.sqrt(torch.mean(xf * xf, dim=dims, keepdim=True) + epsilon)
    y = (xf / rms) * gamma.float()
    return y.to(x.dtype), (1.0 / rms)


# ============================================================================ activations


def npu_swiglu(input, dim=-1):  # noqa: A002 - torch_npu's parameter name
    """Emulates ``torch_npu.npu_swiglu``: ``silu(A) * B`` with A, B the halves of x along dim."""
    op = "npu_swiglu"
    x = input
    _float_dtype(op, "x", x)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim {dim} out of range for a {x.dim()}-D x")
    size = x.shape[dim]
    if size % 2:
        raise ValueError(f"{op}: x size {size} along dim {dim} must be even")
    xf = x.float()
    a = xf.narrow(dim, 0, size // 2)
    b = xf.narrow(dim, size // 2, size // 2)
    return (a / (1.0 + torch.exp(-a)) * b).to(x.dtype)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def npu_gelu(input, *, approximate="none"):  # noqa: A002 - torch_npu's parameter name
    """Emulates ``torch_npu.npu_gelu``: exact erf GELU, or the tanh approximation
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` for ``approximate='tanh'``."""
    op = "npu_gelu"
    _float_dtype(op, "input", input)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    x = input.float()
    if approximate == "tanh":
        y = 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    else:
        y = 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return y.to(input.dtype)


def npu_fast_gelu(input):  # noqa: A002 - torch_npu's parameter name
    """Emulates ``torch_npu.npu_fast_gelu`` with the Atlas A2/A3 formula
    ``x / (1 + exp(-1.702 |x|)) * exp(0.851 (x - |x|))``. Older chips use another formula,
    which is why the op layer never uses this for bias-GELU."""
    _float_dtype("npu_fast_gelu", "input", input)
    x = input.float()
    y = x / (1.0 + torch.exp(-1.702 * x.abs())) * torch.exp(0.851 * (x - x.abs()))
    return y.to(input.dtype)


# ============================================================================ rotary


#: r1/r2 layouts the kernel takes, as (first three dims) patterns over x's dims "0", "1",
#: "2" ("1" = broadcast), grouped by the x layout they imply (torch_npu docs, half mode):
#: x BNSD: 11SD, B1SD, BNSD; x BSND: 1S1D, BS1D, BSND; x SBND: S11D, SB1D, SBND.
_ROTARY_HALF_LAYOUTS = {
    "11SD": (None, None, 2),
    "B1SD": (0, None, 2),
    "1S1D": (None, 1, None),
    "BS1D": (0, 1, None),
    "S11D": (0, None, None),
    "SB1D": (0, 1, None),
    "full": (0, 1, 2),
}
#: interleave mode takes only the sequence-broadcast layouts
_ROTARY_INTERLEAVE_LAYOUTS = ("11SD", "1S1D", "S11D")
#: the S axis of x each r layout implies (None: any layout)
_ROTARY_SEQ_AXIS = {"11SD": 2, "B1SD": 2, "1S1D": 1, "BS1D": 1, "S11D": 0, "SB1D": 0}
_ROTARY_MAX_BN = 1000  # B, N < 1000 (half); B * N < 1000 (interleave)
_ROTARY_MAX_BN_GRAD = 1024  # B * N <= 1024 when r1/r2 need gradients


def _rotary_layout(op, r_shape, x_shape, mode):
    names = _ROTARY_HALF_LAYOUTS if mode == "half" else _ROTARY_INTERLEAVE_LAYOUTS
    for name in names:
        pattern = _ROTARY_HALF_LAYOUTS[name]
        if all(r_shape[i] == (1 if src is None else x_shape[src]) for i, src in enumerate(pattern)):
            return name
    raise ValueError(
        f"{op}: r1/r2 shape {tuple(r_shape)} is not a layout the kernel takes for input "
        f"{tuple(x_shape)} in {mode} mode (documented: {', '.join(n for n in names)})"
    )


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):  # noqa: A002 - torch_npu's name
    """Emulates ``torch_npu.npu_rotary_mul``: ``input * r1 + rotate(input) * r2``; 'half'
    rotates ``(x1, x2) -> (-x2, x1)`` over the two halves of D, 'interleave' over even/odd
    pairs.

    Documented limits enforced (torch_npu 7.x, A2/A3): 4-D tensors in one dtype; D even and
    < 896; r1/r2 in one of the listed broadcast layouts with the full D; r1/r2 values in
    [-1, 1] (they are cos and sin); half mode B, N < 1000, interleave mode B * N < 1000; and
    B * N <= 1024 when r1/r2 need gradients."""
    op = "npu_rotary_mul"
    if rotate is not None:
        raise NotImplementedError(f"{op}: rotate (a custom rotation matrix) is not emulated")
    for arg, t in (("input", input), ("r1", r1), ("r2", r2)):
        _float_dtype(op, arg, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: {arg} must be 4-D, got shape {tuple(t.shape)}")
    if not input.dtype == r1.dtype == r2.dtype:
        raise TypeError(
            f"{op}: input, r1 and r2 must share one dtype, got {_name(input.dtype)}, "
            f"{_name(r1.dtype)}, {_name(r2.dtype)}"
        )
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    d = input.shape[-1]
    if d % 2 or d >= 896:
        raise ValueError(f"{op}: D={d} must be even and < 896")
    if tuple(r1.shape) != tuple(r2.shape):
        raise ValueError(f"{op}: r1 and r2 shapes differ: {tuple(r1.shape)} vs {tuple(r2.shape)}")
    if r1.shape[3] != d:
        raise ValueError(f"{op}: r1/r2 last dim {r1.shape[3]} must be the full D={d}")
    layout = _rotary_layout(op, r1.shape, input.shape, rotary_mode)
    seq_axis = _ROTARY_SEQ_AXIS.get(layout)
    if seq_axis is not None:
        b, n = (input.shape[i] for i in range(3) if i != seq_axis)
        if rotary_mode == "half" and max(b, n) >= _ROTARY_MAX_BN:
            raise ValueError(f"{op}: half mode needs B, N < {_ROTARY_MAX_BN}, got B={b}, N={n}")
        if rotary_mode == "interleave" and b * n >= _ROTARY_MAX_BN:
            raise ValueError(
                f"{op}: interleave mode needs B * N < {_ROTARY_MAX_BN}, got B={b}, N={n}"
            )
        if (r1.requires_grad or r2.requires_grad) and b * n > _ROTARY_MAX_BN_GRAD:
            raise ValueError(
                f"{op}: gradients of r1/r2 need B * N <= {_ROTARY_MAX_BN_GRAD}, got B={b}, N={n}"
            )
    for arg, t in (("r1", r1), ("r2", r2)):
        if t.numel() and float(t.detach().abs().amax()) > 1.0:
            raise ValueError(
                f"{op}: {arg} values must lie in [-1, 1] (cos/sin), got max |{arg}| "
                f"= {float(t.detach().abs().amax()):.4g}"
            )
    x = input.float()
    idx = torch.arange(d, device=input.device)
    if rotary_mode == "half":
        partner = (idx + d // 2) % d
        sign = torch.where(idx < d // 2, -1.0, 1.0)
    else:
        partner = idx ^ 1
        sign = torch.where(idx % 2 == 0, -1.0, 1.0)
    rotated = x.index_select(-1, partner) * sign.to(x.device)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


# ============================================================================ softmax


def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """Emulates ``torch_npu.npu_scaled_masked_softmax``: softmax over the last dim of
    ``x * scale`` with positions where ``mask`` is True replaced by -10000 (fp32 inside), so a
    fully masked row comes out uniform, never zero. ``fixed_triu_mask=True``: the kernel builds
    the causal upper-triangular mask itself (``mask`` must still be a valid bool tensor)."""
    op = "npu_scaled_masked_softmax"
    _float_dtype(op, "x", x)
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D (NCHW), got shape {tuple(x.shape)}")
    h, w = x.shape[-2], x.shape[-1]
    for arg, v in (("x.shape[-2]", h), ("x.shape[-1]", w)):
        if not (32 <= v <= 4096 and v % 32 == 0):
            raise ValueError(f"{op}: {arg}={v} must be in [32, 4096] and divisible by 32")
    if mask.dtype != torch.bool:
        raise TypeError(f"{op}: mask dtype must be bool, got {_name(mask.dtype)}")
    shape = tuple(mask.shape)
    if len(shape) > 4 or any(
        m not in (1, s) for m, s in zip(reversed(shape), reversed(x.shape), strict=False)
    ):
        raise ValueError(f"{op}: mask shape {shape} must broadcast to x {tuple(x.shape)}")
    if fixed_triu_mask:
        # documented: the kernel generates the upper-triangular mask itself (True above the
        # diagonal) and ignores the values of the one passed in
        mask = torch.ones(h, w, dtype=torch.bool, device=x.device).triu_(diagonal=1)
    logits = (x.float() * scale).masked_fill(mask, -10000.0)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    e = torch.exp(shifted)
    return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)


# ============================================================================ optimizer


def npu_apply_adam_w(
    beta1_power,
    beta2_power,
    lr,
    weight_decay,
    beta1,
    beta2,
    epsilon,
    grad,
    max_grad_norm,
    amsgrad,
    maximize,
    *,
    out,
):
    """Emulates ``torch_npu.npu_apply_adam_w`` (in place on ``out=(var, m, v)``).

    The powers passed in are ``beta**(step-1)``: the op multiplies them by beta itself. With
    ``amsgrad`` the running maximum of v is read from ``max_grad_norm`` (it is not an output).
    """
    op = "npu_apply_adam_w"
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError(f"{op}: out must be the tuple (var, m, v)")
    var, m, v = out
    for arg, t in (("var", var), ("m", m), ("v", v), ("grad", grad)):
        _float_dtype(op, arg, t)
        if tuple(t.shape) != tuple(var.shape):
            raise ValueError(
                f"{op}: {arg} shape {tuple(t.shape)} differs from var {tuple(var.shape)}"
            )
    if not var.dtype == m.dtype == v.dtype == grad.dtype:
        raise TypeError(f"{op}: var, m, v and grad must share one dtype")
    if amsgrad and max_grad_norm is None:
        raise ValueError(f"{op}: amsgrad=True needs max_grad_norm (the running max of v)")
    if amsgrad and tuple(max_grad_norm.shape) != tuple(var.shape):
        raise ValueError(f"{op}: max_grad_norm shape must equal var shape")
    b1p = beta1_power * beta1
    b2p = beta2_power * beta2
    g = grad.float()
    if maximize:
        g = -g
    m_new = m.float() * beta1 + (1.0 - beta1) * g
    v_new = v.float() * beta2 + (1.0 - beta2) * g * g
    second = torch.maximum(max_grad_norm.float(), v_new) if amsgrad else v_new
    denom = torch.sqrt(second / (1.0 - b2p)) + epsilon
    var_new = var.float() * (1.0 - lr * weight_decay) - lr * (m_new / (1.0 - b1p)) / denom
    var.copy_(var_new)
    m.copy_(m_new)
    v.copy_(v_new)
    return var, m, v


# ============================================================================ mixture of experts


def _group_ends(op, group_list, group_list_type, groups):
    """Row ranges [start, end) of each group from ``group_list`` (cumulative ends for
    ``group_list_type=0``, counts for 1)."""
    if group_list is None:
        raise ValueError(f"{op}: group_type 0 / 2 needs group_list")
    values = group_list.tolist() if torch.is_tensor(group_list) else list(group_list)
    if len(values) != groups:
        raise ValueError(f"{op}: group_list has {len(values)} entries for {groups} weights")
    if group_list_type == 0:
        ends = [int(v) for v in values]
        if any(b < a for a, b in zip([0, *ends], ends, strict=False)):
            raise ValueError(f"{op}: group_list_type 0 needs a non-decreasing group_list")
    elif group_list_type == 1:
        if any(int(v) < 0 for v in values):
            raise ValueError(f"{op}: group_list_type 1 needs counts >= 0")
        ends = list(itertools.accumulate(int(v) for v in values))
    else:
        raise ValueError(
            f"{op}: group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}"
        )
    return list(zip([0, *ends[:-1]], ends, strict=True))


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
):
    """Emulates ``torch_npu.npu_grouped_matmul`` for floating-point inputs.

    ``group_type`` -1/None: ``x[i] @ weight[i]`` per pair. 0 (split M): one ``x`` [M, K] whose
    rows fall into groups by ``group_list``, times ``weight[g]`` [K, N] (a list, or one [G, K, N]
    tensor); rows past the last group's end are 0. 2 (split K): one ``x`` [K, M] and one
    ``weight`` [M, N], giving ``x[:, g] @ weight[g, :]`` per group, [G, K, N]. ``split_item`` 0/1
    return one tensor per group, 2/3 one tensor (rows concatenated, or stacked for group_type 2).
    fp16/bf16 inputs accumulate in fp32 and round once. The quantised variants (scale, offset,
    antiquant, per-token scale, fused activation) are not emulated and are refused by name.
    """
    op = "npu_grouped_matmul"
    quantised = {
        "scale": scale,
        "offset": offset,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "per_token_scale": per_token_scale,
        "activation_input": activation_input,
        "activation_quant_scale": activation_quant_scale,
        "activation_quant_offset": activation_quant_offset,
    }
    used = [k for k, v in quantised.items() if v is not None]
    if used or act_type not in (0, None) or output_dtype not in (None, 0, 1, 27):
        raise NotImplementedError(
            f"{op}: the quantised / fused-activation forms are not "
            f"emulated (got {', '.join(used) or 'act_type/output_dtype'})"
        )
    if split_item not in (0, 1, 2, 3):
        raise ValueError(f"{op}: split_item must be 0, 1, 2 or 3, got {split_item}")
    if not x or not weight:
        raise ValueError(f"{op}: x and weight must be non-empty tensor lists")
    dtype = x[0].dtype
    for name, ts in (("x", x), ("weight", weight), ("bias", bias or ())):
        for t in ts:
            _float_dtype(op, name, t)
            if t.dtype != dtype:
                raise TypeError(f"{op}: x, weight and bias must share one dtype")
    single_out = split_item in (2, 3)
    if group_type in (None, -1):
        if len(x) != len(weight):
            raise ValueError(f"{op}: group_type -1 pairs x and weight: {len(x)} vs {len(weight)}")
        outs = []
        for i, (xi, wi) in enumerate(zip(x, weight, strict=True)):
            yi = xi.float() @ wi.float()
            if bias is not None:
                yi = yi + bias[i].float()
            outs.append(yi.to(dtype))
        return [torch.cat(outs, dim=0)] if single_out else outs
    if group_type == 0:
        if len(x) != 1:
            raise ValueError(f"{op}: group_type 0 takes one x [M, K], got {len(x)}")
        xs = x[0]
        ws = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else weight
        ranges = _group_ends(op, group_list, group_list_type, len(ws))
        if ranges and ranges[-1][1] > xs.shape[0]:
            raise ValueError(f"{op}: group_list covers {ranges[-1][1]} rows, x has {xs.shape[0]}")
        n = ws[0].shape[1]
        out = torch.zeros(xs.shape[0], n, dtype=torch.float32, device=xs.device)
        parts = []
        for g, (start, end) in enumerate(ranges):
            if ws[g].shape != (xs.shape[1], n):
                raise ValueError(
                    f"{op}: weight {g} is {tuple(ws[g].shape)}, expected {(xs.shape[1], n)}"
                )
            yg = xs[start:end].float() @ ws[g].float()
            if bias is not None:
                yg = yg + bias[g].float()
            out[start:end] = yg
            parts.append(yg.to(dtype))
        return [out.to(dtype)] if single_out else parts
    if group_type == 2:
        if len(x) != 1 or len(weight) != 1:
            raise ValueError(f"{op}: group_type 2 takes one x [K, M] and one weight [M, N]")
        if bias is not None:
            raise ValueError(f"{op}: group_type 2 takes no bias")
        xt, dy = x[0], weight[0]
        if xt.shape[1] != dy.shape[0]:
            raise ValueError(
                f"{op}: x [K, M] and weight [M, N] disagree on M: "
                f"{tuple(xt.shape)}, {tuple(dy.shape)}"
            )
        groups = len(group_list) if group_list is not None else 0
        ranges = _group_ends(op, group_list, group_list_type, groups)
        outs = [(xt[:, a:b].float() @ dy[a:b].float()).to(dtype) for a, b in ranges]
        return [torch.stack(outs)] if single_out else outs
    raise ValueError(f"{op}: group_type must be -1, 0 or 2, got {group_type}")


# ============================================================================ MoE gating


def npu_moe_gating_top_k(
    x,
    k,
    *,
    bias=None,
    input_ids=None,
    tid2eid=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    """Emulates ``torch_npu.npu_moe_gating_top_k`` (the documented CPU golden's steps).

    Scores are the fp32 softmax (``norm_type`` 0) or sigmoid (1) of ``x`` [tokens, experts].
    ``bias`` [experts] is added for the selection only: experts fall into ``group_count`` equal
    groups scored by their best biased score (``group_select_mode`` 0) or the sum of their two
    best (1); the ``k_group`` best groups stay and the ``k`` best of their experts are chosen, in
    descending biased order (ties: lower index first). ``y`` [tokens, k] holds the unbiased
    scores of the chosen experts, with sigmoid divided by their sum plus ``eps``, then times
    ``routed_scaling_factor``, in ``x``'s dtype; ``expert_idx`` is int32; the third output is the
    fp32 scores [tokens, experts] when ``out_flag`` (what the backward needs), else empty. Only
    ``renorm=0`` exists; the hash mode (``input_ids`` / ``tid2eid``) is not emulated.
    """
    op = "npu_moe_gating_top_k"
    _float_dtype(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [tokens, experts], got {x.dim()}-D")
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError(f"{op}: the hash mode (input_ids / tid2eid) is not emulated")
    tokens, experts = x.shape
    if not 2 <= experts <= 2048:
        raise ValueError(f"{op}: the expert count must be in [2, 2048], got {experts}")
    if norm_type not in (0, 1) or renorm != 0 or group_select_mode not in (0, 1):
        raise ValueError(
            f"{op}: norm_type must be 0 or 1, renorm 0, group_select_mode 0 or 1 "
            f"(got {norm_type}, {renorm}, {group_select_mode})"
        )
    if group_count < 1 or experts % group_count or not 1 <= k_group <= group_count:
        raise ValueError(
            f"{op}: group_count {group_count} must divide the {experts} experts "
            f"and 1 <= k_group {k_group} <= group_count"
        )
    per_group = experts // group_count
    if group_select_mode == 1 and group_count > 1 and per_group < 2:
        raise ValueError(f"{op}: group_select_mode 1 needs at least 2 experts per group")
    if not 1 <= k <= per_group * k_group:
        raise ValueError(
            f"{op}: k {k} must be in [1, experts per group x k_group = {per_group * k_group}]"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != experts or bias.dtype != x.dtype):
        raise ValueError(f"{op}: bias must be 1-D [{experts}] in x's dtype")
    scores = torch.softmax(x.float(), dim=-1) if norm_type == 0 else torch.sigmoid(x.float())
    chooser = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = chooser.view(tokens, group_count, per_group)
        if group_select_mode == 0:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
        kept = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :k_group]
        keep = torch.zeros(tokens, group_count, dtype=torch.bool, device=x.device)
        keep.scatter_(1, kept, True)
        chooser = chooser.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    idx = chooser.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = scores if out_flag else scores.new_empty(0)
    return y.to(x.dtype), idx.to(torch.int32), out


def npu_moe_gating_top_k_backward(  # noqa: N803 - torch_npu's parameter name expertIdx
    x_norm, grad_y, expertIdx, *, renorm=0, norm_type=0, routed_scaling_factor=1.0, eps=1e-20
):
    """Emulates ``torch_npu.npu_moe_gating_top_k_backward``: the gradient of the sigmoid
    gating's ``x`` from the fp32 scores ``x_norm`` [tokens, experts], ``grad_y`` [tokens, k] and
    the chosen ``expert_idx``; only ``norm_type`` 1 (sigmoid) exists. With ``w' = x_norm`` at the
    chosen experts, ``D = sum(w') + eps`` and ``w = w' / D``: ``dw' = (s g - sum(w s g)) / D``
    (``s`` the scaling factor), scattered to the chosen experts and times the sigmoid's
    derivative ``x_norm (1 - x_norm)``. In ``grad_y``'s dtype."""
    op = "npu_moe_gating_top_k_backward"
    if norm_type != 1:
        raise ValueError(f"{op}: only norm_type 1 (sigmoid) is supported, got {norm_type}")
    if x_norm.dtype != torch.float32 or x_norm.dim() != 2:
        raise TypeError(f"{op}: x_norm must be 2-D float32")
    _float_dtype(op, "grad_y", grad_y)
    if expertIdx.dtype != torch.int32 or expertIdx.shape != grad_y.shape:
        raise TypeError(f"{op}: expertIdx must be int32 and shaped like grad_y")
    idx = expertIdx.long()
    chosen = x_norm.gather(1, idx)
    total = chosen.sum(dim=-1, keepdim=True) + eps
    weights = chosen / total
    scaled = grad_y.float() * routed_scaling_factor
    grad_chosen = (scaled - (weights * scaled).sum(dim=-1, keepdim=True)) / total
    grad_norm = torch.zeros_like(x_norm).scatter_add(1, idx, grad_chosen)
    return (x_norm * (1 - x_norm) * grad_norm).to(grad_y.dtype)


# ============================================================================ MoE token permutation

_INDEX_DTYPES = (torch.bool, torch.int8)


def _routing_map(op: str, routing_map: torch.Tensor, tokens_num: int | None = None) -> torch.Tensor:
    if routing_map.dim() != 2 or routing_map.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"{op}: routing_map must be a 2-D bool or int8 tensor, got "
            f"{routing_map.dim()}-D {_name(routing_map.dtype)}"
        )
    if tokens_num is not None and routing_map.shape[0] != tokens_num:
        raise ValueError(
            f"{op}: routing_map has {routing_map.shape[0]} rows for {tokens_num} tokens"
        )
    return routing_map.bool()


def npu_moe_token_permute_with_routing_map(
    tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False
):
    """Emulates ``torch_npu.npu_moe_token_permute_with_routing_map``: copies of the tokens
    grouped by expert (expert 0's tokens first, each expert's in token order).

    Without ``drop_and_pad`` every row of ``routing_map`` must select the same number topK of
    experts, ``num_out_tokens // tokens_num``; ``sorted_indices`` [tokens_num * topK] gives, for
    the k-th selected expert of token t (slot ``t * topK + k``), the row of the output holding
    that copy. With ``drop_and_pad`` each expert keeps ``capacity = num_out_tokens //
    experts_num`` rows, its selected tokens first (in token order) and then unselected tokens
    as padding, and ``sorted_indices`` is the token of each output row. ``permuted_probs``
    holds ``probs[token, expert]`` of each output row (None without ``probs``). Differentiable
    in ``tokens`` and ``probs``.
    """
    op = "npu_moe_token_permute_with_routing_map"
    _float_dtype(op, "tokens", tokens)
    if tokens.dim() != 2:
        raise ValueError(f"{op}: tokens must be [tokens_num, hidden], got {tuple(tokens.shape)}")
    chosen = _routing_map(op, routing_map, tokens.shape[0])
    tokens_num, experts_num = chosen.shape
    if probs is not None:
        _float_dtype(op, "probs", probs)
        if probs.shape != chosen.shape:
            raise ValueError(
                f"{op}: probs {tuple(probs.shape)} must match routing_map {tuple(chosen.shape)}"
            )
        if probs.dtype != tokens.dtype and not (
            probs.dtype == torch.float32 and tokens.dtype == torch.bfloat16
        ):
            raise TypeError(
                f"{op}: probs {_name(probs.dtype)} with tokens "
                f"{_name(tokens.dtype)}: only float32 probs may differ "
                f"(with bfloat16 tokens)"
            )
    out_tokens = tokens_num if num_out_tokens is None else int(num_out_tokens)
    if not 0 <= out_tokens <= tokens_num * experts_num:
        raise ValueError(
            f"{op}: num_out_tokens {out_tokens} is outside [0, {tokens_num * experts_num}]"
        )
    if drop_and_pad:
        capacity = out_tokens // experts_num
        rows = []  # per expert: its selected tokens in order, then the rest as padding
        for e in range(experts_num):
            column = chosen[:, e]
            order = torch.cat([column.nonzero().flatten(), (~column).nonzero().flatten()])
            rows.append(order[:capacity])
        token_of_row = torch.cat(rows) if rows else chosen.new_zeros(0, dtype=torch.long)
        expert_of_row = torch.arange(experts_num, device=tokens.device).repeat_interleave(capacity)
        sorted_indices = token_of_row
    else:
        topk = out_tokens // tokens_num if tokens_num else 0
        per_row = chosen.sum(dim=1)
        if tokens_num and not bool((per_row == topk).all()):
            raise ValueError(
                f"{op}: without drop_and_pad every routing_map row must select "
                f"topK = num_out_tokens // tokens_num = {topk} experts; rows select "
                f"{sorted(set(per_row.tolist()))}"
            )
        pairs = chosen.t().nonzero()  # (expert, token), expert-major: the output rows
        expert_of_row, token_of_row = pairs[:, 0], pairs[:, 1]
        # slot t * topK + k is the k-th row (in output order) that copies token t
        sorted_indices = torch.sort(token_of_row, stable=True).indices
    permuted = tokens.index_select(0, token_of_row)
    permuted_probs = None if probs is None else probs[token_of_row, expert_of_row]
    return permuted, permuted_probs, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute_with_routing_map(
    permuted_tokens,
    sorted_indices,
    restore_shape,
    *,
    probs=None,
    routing_map=None,
    drop_and_pad=False,
):
    """Emulates ``torch_npu.npu_moe_token_unpermute_with_routing_map``: the inverse of the
    permute, summing each token's copies (weighted by ``probs[token, expert]`` when given) into
    a ``restore_shape`` [tokens_num, hidden] tensor.

    Without ``drop_and_pad``, ``sorted_indices`` is the permute's slot map: slot ``i`` belongs to
    token ``i // topK`` (``topK = permuted rows // tokens_num``) and names its row; ``-1`` marks
    an unused slot. With ``drop_and_pad`` it is the token of each row, rows in blocks of
    ``capacity`` per expert. ``probs`` needs ``routing_map`` (which selects, without
    drop_and_pad, each row's expert in the permute's order). The sum is taken in float32 and
    rounded once. Differentiable in ``permuted_tokens`` and ``probs``.
    """
    op = "npu_moe_token_unpermute_with_routing_map"
    _float_dtype(op, "permuted_tokens", permuted_tokens)
    if permuted_tokens.dim() != 2:
        raise ValueError(f"{op}: permuted_tokens must be 2-D, got {tuple(permuted_tokens.shape)}")
    if sorted_indices.dtype != torch.int32 or sorted_indices.dim() != 1:
        raise TypeError(
            f"{op}: sorted_indices must be a 1-D int32 tensor, got "
            f"{sorted_indices.dim()}-D {_name(sorted_indices.dtype)}"
        )
    tokens_num, hidden = (int(v) for v in restore_shape)
    rows = permuted_tokens.shape[0]
    if permuted_tokens.shape[1] != hidden:
        raise ValueError(
            f"{op}: permuted_tokens are {permuted_tokens.shape[1]} wide, restore_shape {hidden}"
        )
    if probs is not None and routing_map is None:
        raise ValueError(f"{op}: probs need routing_map")
    index = sorted_indices.long()
    if drop_and_pad:
        if index.numel() != rows:
            raise ValueError(
                f"{op}: drop_and_pad needs one sorted index per permuted row "
                f"({index.numel()} for {rows})"
            )
        token_of_row = index
        weight = None
        if probs is not None:
            experts_num = probs.shape[1]
            capacity = rows // experts_num if experts_num else 0
            expert_of_row = torch.arange(experts_num, device=index.device).repeat_interleave(
                capacity
            )
            weight = probs[token_of_row, expert_of_row]
        source = permuted_tokens
    else:
        topk = rows // tokens_num if tokens_num else 0
        if index.numel() != tokens_num * topk:
            raise ValueError(
                f"{op}: sorted_indices has {index.numel()} slots for "
                f"{tokens_num} tokens x topK {topk}"
            )
        used = index >= 0
        slot_token = torch.arange(index.numel(), device=index.device) // max(topk, 1)
        token_of_row = torch.full((rows,), -1, dtype=torch.long, device=index.device)
        token_of_row[index[used]] = slot_token[used]
        weight = None
        if probs is not None:
            chosen = _routing_map(op, routing_map, tokens_num)
            pairs = chosen.t().nonzero()  # the permute's rows: (expert, token), expert-major
            if pairs.shape[0] != rows:
                raise ValueError(
                    f"{op}: routing_map selects {pairs.shape[0]} (token, expert) "
                    f"pairs for {rows} permuted rows"
                )
            weight = probs[pairs[:, 1], pairs[:, 0]]
        keep = token_of_row >= 0
        source, token_of_row = permuted_tokens[keep], token_of_row[keep]
        weight = None if weight is None else weight[keep]
    contribution = source.float()
    if weight is not None:
        contribution = contribution * weight.float().unsqueeze(-1)
    out = torch.zeros(tokens_num, hidden, dtype=torch.float32, device=permuted_tokens.device)
    out = out.index_add(0, token_of_row, contribution)
    return out.to(permuted_tokens.dtype)


# ============================================================================ call counting

_counters: list[Counter] = []
_counters_lock = threading.Lock()


@contextmanager
def count_kernel_calls() -> Iterator[Counter]:
    """Count every emulated kernel call by name while the block runs.

    Yields a :class:`collections.Counter` (kernel name -> calls) that fills in as kernels run;
    nested or concurrent blocks each see every call made while they are active. Counting wraps
    the public ``npu_*`` functions of this module, so it sees calls through ``torch_npu.<name>``
    and ``megatron_npu.ops.kernels`` alike, never the native torch paths.
    """
    with _registered(_counters, Counter()) as counter:
        yield counter


_site_sets: list[set] = []


@contextmanager
def record_call_sites() -> Iterator[set[tuple[str, int, str]]]:
    """Record where emulated kernels are called from while the block runs.

    Yields a set that fills with ``(file, line, kernel)`` of each call's immediate caller: the
    places in the adaptor whose calls went through the schema check."""
    with _registered(_site_sets, set()) as sites:
        yield sites


@contextmanager
def _registered(collectors: list, collector: Any) -> Iterator[Any]:
    """``collector`` in ``collectors`` while the block runs (found again by identity: two
    counters with equal counts compare equal, e.g. nested blocks)."""
    with _counters_lock:
        collectors.append(collector)
    try:
        yield collector
    finally:
        with _counters_lock:
            del collectors[next(i for i, c in enumerate(collectors) if c is collector)]


def _checked(kernel):
    """``kernel`` behind two steps: the call is bound against the real kernel's schema
    (:func:`megatron_npu.devices.torch_npu_schema.bind`: a call torch_npu would reject fails
    here too, whatever the emulation's own signature accepts), then counted."""
    name = kernel.__name__

    @functools.wraps(kernel)
    def call(*args, **kwargs):
        torch_npu_schema.bind(name, args, kwargs)
        if _counters or _site_sets:
            caller = sys._getframe(1)
            site = (caller.f_code.co_filename, caller.f_lineno, name)
            with _counters_lock:
                for counter in _counters:
                    counter[name] += 1
                for sites in _site_sets:
                    sites.add(site)
        return kernel(*args, **kwargs)

    return call


#: the emulated kernels, by torch_npu name
KERNELS: tuple[str, ...] = tuple(name for name in __all__ if name.startswith("npu_"))
for _name_ in KERNELS:
    globals()[_name_] = _checked(globals()[_name_])
del _name_
