"""The config fingerprint: what must be equal for two runs to be the same model on the same data.

Read from each run's ``metrics.json`` ``config`` (what the run actually used, after Megatron's
derivations such as the padded vocabulary), never from the matrix text. Fields:

* model shape: ``num_layers, hidden_size, ffn_hidden_size, num_attention_heads,
  num_query_groups, kv_channels, seq_length, max_position_embeddings, position_embedding_type,
  normalization, swiglu, bias_linear, tied_embeddings, init_method_std, attention_window``
  (the fused attention's pre/next-token window: a sparse window computes another function than
  full causal attention; the flash kernel with the full window does not), ``attention`` (the
  kind: standard or multi-latent with its ranks and head widths, and query/key norms),
  ``experts`` (dense, or the MoE layers' expert count, top-k, expert and shared-expert FFN
  sizes, capacity factor and aux-loss coefficient: each changes what is computed; the
  expert-parallel layout does not);
* ``padded_vocab_size`` (Megatron pads to divisible-by x TP: see ``align_vocab`` in
  :mod:`.matrix`);
* ``data``: the data source and the dataset identity (the indexed prefixes' file names -- the
  embedded corpus's carries its content hash -- or Megatron's mock dataset), plus ``--split``;
* ``seed``;
* ``init``: where the initial weights come from -- megatron-npu's layout-independent stream
  (``--layout-independent-init``: the same weights in every layout and on every device), or
  Megatron's own initialisation, on the host (``--use-cpu-initialization``: one CPU stream per
  weight, the same on every device) or on the device (each tensor-parallel rank draws its shard
  from the device's own generator, so a CUDA run and a CPU-drawn run start from other weights);
* ``tokenizer``: type and vocab/merge file names.

A candidate whose fingerprint differs from its reference on a field the matrix does not list in
``[compare] vary`` is *refused*: no loss verdict is given, and the refusal names the fields.
"""

from __future__ import annotations

import os
import re
from typing import Any

from megatron_npu.devices.facts import known
from megatron_npu.formats.metrics import RunConfig, RunData

MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "bias_linear",
    "tied_embeddings",
    "init_method_std",
    "attention_window",
    "attention",
    "experts",
)
FIELDS = (*MODEL_FIELDS, "padded_vocab_size", "data", "seed", "init", "tokenizer")


def _names(paths: Any) -> list[str]:
    if not paths:
        return []
    items = paths if isinstance(paths, list) else [paths]
    return [os.path.basename(str(p)) if not _is_number(p) else str(p) for p in items]


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _window(args: dict[str, Any]) -> str:
    from megatron_npu.ops.settings import FULL_WINDOW

    pre = args.get("pre_tokens", FULL_WINDOW)
    nxt = args.get("next_tokens", FULL_WINDOW)
    pre = "full" if pre is None or pre >= FULL_WINDOW else pre
    nxt = "full" if nxt is None or nxt >= FULL_WINDOW else nxt
    return f"causal, pre {pre}, next {nxt}"


def _experts(args: dict[str, Any]) -> str:
    experts = args.get("num_experts")
    if not experts:
        return "dense"
    ffn = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
    groups = args.get("moe_router_num_groups")
    freq = args.get("moe_layer_freq", 1)
    return (
        f"{experts} experts, top-{args.get('moe_router_topk', 2)}, ffn {ffn}, shared "
        f"{args.get('moe_shared_expert_intermediate_size') or 0}, capacity "
        f"{args.get('moe_expert_capacity_factor') or 'none'}, aux coeff "
        f"{args.get('moe_aux_loss_coeff') or 0}, router "
        f"{args.get('moe_router_score_function') or 'softmax'}"
        f"{' with expert bias' if args.get('moe_router_enable_expert_bias') else ''}"
        f"{' grouped ' + str(groups) if groups else ''}"
        f"{', layer freq ' + str(freq) if freq != 1 else ''}"
    )


def _attention(args: dict[str, Any]) -> str:
    """Standard or multi-latent attention (its ranks and head widths), with query/key norms."""
    kind = "standard"
    if args.get("multi_latent_attention"):
        kind = (
            f"multi-latent, q rank {args.get('q_lora_rank') or 'none'}, kv rank "
            f"{args.get('kv_lora_rank')}, qk {args.get('qk_head_dim')}"
            f"+{args.get('qk_pos_emb_head_dim')}, v {args.get('v_head_dim')}, rope "
            f"{args.get('rope_type') or 'yarn'}"
        )
    return f"{kind}, qk norm" if args.get("qk_layernorm") else kind


def _init(args: dict[str, Any], device: str | None) -> str:
    if args.get("layout_independent_init"):
        return "layout-independent"
    if args.get("use_cpu_initialization"):
        return "megatron, host"
    facts = known(device)
    return f"megatron, device ({facts.torch_type if facts else device or 'unknown'} generator)"


def fingerprint(config: RunConfig, device: str | None = None) -> dict[str, Any]:
    """The fingerprint of one run from its ``metrics.json`` ``config`` block; ``device``: the
    device the run ran on where its file does not say (an imported log's, the matrix's)."""
    args = config.arguments
    heads = args.get("num_attention_heads")
    kv = args.get("kv_channels") or (
        args["hidden_size"] // heads if heads and args.get("hidden_size") else None
    )
    out: dict[str, Any] = {
        "num_layers": args.get("num_layers"),
        "hidden_size": args.get("hidden_size"),
        "ffn_hidden_size": args.get("ffn_hidden_size"),
        "num_attention_heads": heads,
        # Megatron reads num_query_groups only with group_query_attention (else one group per
        # head), and Megatron-LM's argument dump shows its unused default 1
        "num_query_groups": args.get("num_query_groups")
        if args.get("group_query_attention")
        else heads,
        "kv_channels": kv,
        "seq_length": args.get("seq_length"),
        "max_position_embeddings": args.get("max_position_embeddings"),
        "position_embedding_type": args.get("position_embedding_type"),
        "normalization": args.get("normalization"),
        "swiglu": bool(args.get("swiglu")),
        # Megatron-LM's argument dump names it by its destination, add_bias_linear (its
        # --disable-bias-linear stores False there); megatron-npu train's by the flag
        "bias_linear": bool(args["add_bias_linear"])
        if "add_bias_linear" in args
        else not args.get("disable_bias_linear"),
        "tied_embeddings": not args.get("untie_embeddings_and_output_weights"),
        "init_method_std": args.get("init_method_std"),
        "padded_vocab_size": config.padded_vocab_size,
        "attention_window": _window(args),
        "attention": _attention(args),
        "experts": _experts(args),
    }
    data = config.data or RunData()
    source = data.source
    if args.get("mock_data"):
        # Megatron's MockGPTDataset: its tokens are (1, 2, ...) modulo the tokenizer's vocabulary,
        # then EOD. The tokenizer's size is what the description says ("vocab N"; train and
        # Megatron-LM build the same NullTokenizer for one --vocab-size on one release).
        described = re.search(r"\bvocab (\d+)", str(data.description or ""))
        identity = f"vocab {described.group(1) if described else args.get('vocab_size')}"
    elif args.get("data_path"):
        identity = " ".join(_names(args.get("data_path")))
    else:
        described = str(data.description or "")
        prefix = next((w for w in described.split() if os.sep in w), "")
        identity = os.path.basename(prefix.rstrip(",")) or described
    out["data"] = f"{source}: {identity} split {args.get('split') or '100,0,0'}"
    out["seed"] = args.get("seed")
    out["init"] = _init(args, config.device or device)
    tokenizer = args.get("tokenizer_type") or (
        "NullTokenizer" if args.get("mock_data") else "ByteLevel"
    )
    files = _names([f for f in (args.get("vocab_file"), args.get("merge_file")) if f])
    out["tokenizer"] = " ".join([tokenizer, *files])
    return out


def differences(
    reference: dict[str, Any], candidate: dict[str, Any], vary: tuple[str, ...] = ()
) -> list[tuple[str, Any, Any]]:
    """``(field, reference value, candidate value)`` for every differing field not in ``vary``."""
    return [
        (name, reference.get(name), candidate.get(name))
        for name in FIELDS
        if name not in vary and reference.get(name) != candidate.get(name)
    ]
