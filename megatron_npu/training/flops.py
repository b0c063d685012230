"""Model FLOPs per training iteration for GPT: Megatron-LM's ``num_floating_point_operations``.

Megatron-LM (``megatron/training/training.py``) counts only the matrix multiplications of a dense
GPT, forward plus backward, as

    12 * B * s * L * h^2 * ( attention + mlp + logits )

where the factor 12 = 3 * 2 * 2:

* 3: every GEMM runs three times per step (forward, backward data-gradient, backward
  weight-gradient), so a training step costs three forward passes;
* 2: the GEMMs of a transformer layer come in pairs of the same size (QKV/projection, h->ffn and
  ffn->h);
* 2: an ``m x n`` by ``n x k`` GEMM costs ``2 m n k`` floating-point operations (multiply + add).

and the bracket, with ``r = kv_channels * heads / h`` (1 when ``kv_channels = h / heads``):

* **attention** ``(1 + groups / heads + s / h * c) * r``: the query and output projections (1),
  the key/value projections shrunk by grouped-query attention (``groups / heads``), and the two
  batched GEMMs ``Q K^T`` and ``softmax(Q K^T) V`` (``s / h``); ``c = 1/2`` for causal attention
  because only the lower triangle of the score matrix is non-zero (Megatron-LM counts the half since
  late 2024; ``causal=False`` gives the older full-matrix count);
* **MLP** ``ffn / h * g``: the two MLP GEMMs, ``g = 3/2`` with SwiGLU (its gate is a third GEMM of
  the same size). In a mixture-of-experts layer only the experts a token is routed to work on
  it, so ``ffn`` is the *active* size (:func:`active_ffn_hidden_size`: top-k times the expert
  FFN size, plus the shared expert's), as Megatron-LM counts it; the router's ``h x E`` gating
  GEMM is left out, being small next to the experts';
* **logits** ``V / (2 L h)``: the output layer's ``h x V`` GEMM, once per model rather
  than per layer.

Multi-latent attention replaces the attention bracket by Megatron-LM's own count of its GEMMs
(:func:`mla_attention_flops_per_token`): the query's down and up projections (or its one
projection without ``--q-lora-rank``), the key/value latent's down and up projections, the
shared positional key, the output projection, and the two batched GEMMs over q/k heads of
``qk + pos`` features and v heads of ``v`` features, halved for the causal mask.

Not counted (as in Megatron-LM): embeddings lookups, norms, softmax, activations, the loss, the
optimizer step, and recomputation. The result is the work of the *whole model* for one global batch
(all data-parallel replicas together), independent of the TP/PP layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def active_ffn_hidden_size(
    ffn_hidden_size: int,
    *,
    num_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
    moe_router_topk: int = 2,
    moe_shared_expert_intermediate_size: int | None = None,
    moe_layer_share: float = 1.0,
) -> float:
    """The FFN width one token passes through, per layer: the dense FFN, or with ``num_experts``
    the top-k routed experts' plus the shared expert's in the MoE layers (``moe_layer_share`` of
    the layers, ``--moe-layer-freq``) and the dense FFN in the others."""
    if num_experts is None:
        return ffn_hidden_size
    expert = moe_ffn_hidden_size if moe_ffn_hidden_size is not None else ffn_hidden_size
    active = moe_router_topk * expert + (moe_shared_expert_intermediate_size or 0)
    if moe_layer_share == 1.0:
        return active
    return moe_layer_share * active + (1.0 - moe_layer_share) * ffn_hidden_size


def mlp_forward_flops(
    tokens: float, hidden_size: int, ffn_hidden_size: float, *, swiglu: bool
) -> float:
    """Forward FLOPs of the MLP GEMMs for ``tokens`` tokens: ``h -> ffn`` and ``ffn -> h`` at
    ``2 m n k`` each, plus SwiGLU's gate (a third GEMM of the same size). ``ffn_hidden_size`` is
    the width a token passes through (:func:`active_ffn_hidden_size` for an MoE layer)."""
    return 2.0 * 2.0 * tokens * hidden_size * ffn_hidden_size * (1.5 if swiglu else 1.0)


def mla_attention_flops_per_token(
    *,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    qk_head_dim: int,
    qk_pos_emb_head_dim: int,
    v_head_dim: int,
) -> float:
    """Forward + backward FLOPs of one multi-latent attention layer per token, as Megatron-LM
    counts them (its norms' ``+ 1`` terms included)."""
    h, n = hidden_size, num_attention_heads
    q_width = n * (qk_head_dim + qk_pos_emb_head_dim)
    if q_lora_rank is None:
        query = h * q_width
    else:
        query = q_lora_rank * (h + q_width + 1)
    key_value = kv_lora_rank * (h + n * (qk_head_dim + v_head_dim) + 1)
    positional_key = h * qk_pos_emb_head_dim
    output = n * v_head_dim * h
    core = seq_length * q_width / 2 + seq_length * n * v_head_dim / 2  # causal: half the scores
    return 3.0 * 2.0 * (query + key_value + positional_key + output + core)


def gpt_model_flops_per_iteration(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    seq_length: int,
    padded_vocab_size: int,
    global_batch_size: int,
    swiglu: bool,
    causal: bool,
    kv_channels: int | None = None,
    attention_flops_per_token: float | None = None,
) -> float:
    """Forward + backward FLOPs of one GPT training iteration (one global batch);
    ``attention_flops_per_token``: one layer's attention per token in place of the standard
    bracket (:func:`mla_attention_flops_per_token`)."""
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("ffn_hidden_size", ffn_hidden_size),
        ("num_attention_heads", num_attention_heads),
        ("num_query_groups", num_query_groups),
        ("seq_length", seq_length),
        ("padded_vocab_size", padded_vocab_size),
        ("global_batch_size", global_batch_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if kv_channels is None:
        kv_channels = hidden_size // num_attention_heads
    h = float(hidden_size)
    query_ratio = kv_channels * num_attention_heads / h
    causal_share = 0.5 if causal else 1.0
    if attention_flops_per_token is None:
        attention = (
            1.0 + num_query_groups / num_attention_heads + seq_length / h * causal_share
        ) * query_ratio
    else:
        attention = attention_flops_per_token / (12.0 * h * h)
    mlp = mlp_forward_flops(1, hidden_size, ffn_hidden_size, swiglu=swiglu) / (4.0 * h * h)
    logits = padded_vocab_size / (2.0 * num_layers * h)
    return 12.0 * global_batch_size * seq_length * num_layers * h * h * (attention + mlp + logits)


def moe_layer_share(num_experts: int | None, moe_layer_freq: Any, num_layers: int) -> float:
    """The share of the layers that are MoE layers (``--moe-layer-freq``); 0 for a dense model."""
    from megatron_npu.moe_options import moe_layer_pattern

    if not num_experts:
        return 0.0
    pattern = moe_layer_pattern(moe_layer_freq if moe_layer_freq is not None else 1, num_layers)
    return sum(pattern) / len(pattern)


def model_flops_per_step(args: Any, padded_vocab_size: int) -> float:
    """Megatron-LM's count for one training iteration from its arguments by their Megatron
    names (an argparse namespace, or the mapping of a Megatron-LM log's argument dump): causal
    attention (a pre/next window is not credited, as in Megatron), the query groups only with
    ``group_query_attention``, MoE layers counting their active experts only."""
    get = args.get if isinstance(args, Mapping) else (lambda name: getattr(args, name, None))
    heads = get("num_attention_heads")
    num_experts = get("num_experts")
    mla = None
    if get("multi_latent_attention"):
        mla = mla_attention_flops_per_token(
            hidden_size=get("hidden_size"),
            num_attention_heads=heads,
            seq_length=get("seq_length"),
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_head_dim=get("qk_head_dim"),
            qk_pos_emb_head_dim=get("qk_pos_emb_head_dim"),
            v_head_dim=get("v_head_dim"),
        )
    return gpt_model_flops_per_iteration(
        num_layers=get("num_layers"),
        hidden_size=get("hidden_size"),
        ffn_hidden_size=active_ffn_hidden_size(
            get("ffn_hidden_size"),
            num_experts=num_experts,
            moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
            moe_router_topk=get("moe_router_topk") or 2,
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
            moe_layer_share=moe_layer_share(num_experts, get("moe_layer_freq"), get("num_layers")),
        ),
        num_attention_heads=heads,
        num_query_groups=(get("num_query_groups") or heads)
        if get("group_query_attention") in (None, True)
        else heads,
        seq_length=get("seq_length"),
        padded_vocab_size=padded_vocab_size,
        global_batch_size=get("global_batch_size"),
        swiglu=bool(get("swiglu")),
        causal=True,
        kv_channels=get("kv_channels"),
        attention_flops_per_token=mla,
    )
