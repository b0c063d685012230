"""The yardstick: the GPT that ``megatron-npu train`` builds, written in plain PyTorch.

Same architecture as Megatron-Core's ``GPTModel`` on the local layer spec with this project's
defaults (learned absolute positions, pre-LayerNorm, biased linears, GeLU MLP of 4h, tied output
embedding; Megatron's embedding, attention and hidden dropout where asked for, none by default),
the same attention kernel (``scaled_dot_product_attention(is_causal=True)``, what the adaptor's
fused attention runs), and a training step shaped like Megatron's: the global batch as
``micro_batches`` micro-batches, each one's token-mean cross entropy over their number
backpropagated in turn, gradient clipping to norm 1, ``torch.optim.AdamW(foreach=True)`` on fp32
master weights (copied to the model's dtype when that is 16-bit, as Megatron's mixed-precision
optimizer does). The batches stay on the device: the step times the model and optimizer alone.

:func:`twin_of` builds the trainer a ``megatron-npu train`` command line describes, and refuses
one whose model this file does not write.

Used by ``perf/test_gpt_step_bench.py`` and ``perf/gpu_check.py`` (on ``cuda``); nothing in the
adaptor imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # padded, as Megatron's
    micro_batch_size: int
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        h = shape.hidden_size
        self.heads = shape.num_attention_heads
        self.attention_dropout = shape.attention_dropout
        self.dropout = nn.Dropout(shape.hidden_dropout)
        self.norm1 = nn.LayerNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=1e-5)
        self.fc1 = nn.Linear(h, shape.ffn_hidden_size)
        self.fc2 = nn.Linear(shape.ffn_hidden_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, s, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class PlainGPT(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.word = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position = nn.Embedding(shape.seq_length, shape.hidden_size)
        self.embedding_dropout = nn.Dropout(shape.hidden_dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.final_norm = nn.LayerNorm(shape.hidden_size, eps=1e-5)
        for param in self.parameters():
            if param.dim() > 1:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_dropout(self.word(tokens) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.final_norm(x) @ self.word.weight.t()  # tied output layer
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class PlainTrainer:
    """One Megatron-shaped training step of :class:`PlainGPT` (module docstring)."""

    def __init__(
        self,
        shape: GPTShape,
        dtype: torch.dtype,
        seed: int = 0,
        device: str = "cpu",
        micro_batches: int = 1,
    ) -> None:
        torch.manual_seed(seed)
        self.shape, self.dtype, self.micro_batches = shape, dtype, micro_batches
        self.model = PlainGPT(shape).to(device=device, dtype=dtype)
        params = list(self.model.parameters())
        self.mixed = dtype != torch.float32
        self.master = [p.detach().float().clone() for p in params] if self.mixed else params
        self.optimizer = torch.optim.AdamW(
            self.master, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=True
        )
        gen = torch.Generator().manual_seed(seed)
        size = (micro_batches, shape.micro_batch_size, shape.seq_length + 1)
        data = torch.randint(0, shape.vocab_size, size, generator=gen)
        data = data.to(device)
        self.tokens, self.labels = data[..., :-1], data[..., 1:]

    def step(self) -> float:
        params = list(self.model.parameters())
        for p in params:
            p.grad = None
        total = 0.0
        for tokens, labels in zip(self.tokens, self.labels, strict=True):
            loss = self.model(tokens, labels) / self.micro_batches
            loss.backward()
            total += loss.detach()
        if self.mixed:
            for master, p in zip(self.master, params, strict=True):
                master.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(self.master, 1.0, foreach=True)
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(params, self.master)
        return float(total)


def twin_of(argv: Sequence[str], device: str = "cpu") -> PlainTrainer:
    """The plain trainer of the model, batch and dropout a ``megatron-npu train`` command line
    gives (train's own parser and defaults; the vocabulary padded as train pads it). A model this
    file does not write (another norm, position embedding or MLP, GQA, other head widths, a
    longer position table, experts, untied output, no biases, model parallelism, more than one
    rank) or whose step it does not take (fp16's loss scaling, SGD, another clipping norm,
    Megatron's unfused attention: its attention is SDPA's fused kernel) is a ``ValueError``
    naming the option."""
    from megatron_npu.training import model, preflight
    from megatron_npu.training.options import TrainOptions

    options = TrainOptions.parse(argv)
    args = options.args
    head_width = args.hidden_size // args.num_attention_heads
    unlike = {
        "--normalization": args.normalization != "LayerNorm",
        "--position-embedding-type": args.position_embedding_type != "learned_absolute",
        "--swiglu": args.swiglu,
        "--ffn-hidden-size": args.ffn_hidden_size != 4 * args.hidden_size,
        "--group-query-attention": args.num_query_groups != args.num_attention_heads,
        "--kv-channels": args.kv_channels not in (None, head_width),
        "--max-position-embeddings": args.max_position_embeddings != args.seq_length,
        "--num-experts": args.num_experts is not None,
        "--untie-embeddings-and-output-weights": args.untie_embeddings_and_output_weights,
        "--disable-bias-linear": args.disable_bias_linear,
        "--tensor-model-parallel-size": args.tensor_model_parallel_size != 1,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size != 1,
        "--context-parallel-size": args.context_parallel_size != 1,
        "--nproc-per-node/--nnodes (more than one rank)": options.world_size != 1,
        "--fp16 (a loss-scaled step)": args.fp16,
        "--optimizer sgd": args.optimizer != "adam",
        "--clip-grad other than 1.0": args.clip_grad != 1.0,
        "no --use-flash-attn (Megatron's unfused attention)": not args.use_flash_attn,
    }
    refused = [name for name, differs in unlike.items() if differs]
    if refused:
        raise ValueError(f"the plain GPT does not write a model with {', '.join(refused)}")
    if args.global_batch_size % args.micro_batch_size:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size}"
        )
    shape = GPTShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=model.padded_vocab_size(preflight.tokenizer_vocab_size(args), args),
        micro_batch_size=args.micro_batch_size,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
    )
    dtype = model.params_dtype(args)
    micro_batches = args.global_batch_size // args.micro_batch_size
    return PlainTrainer(shape, dtype, seed=args.seed, device=device, micro_batches=micro_batches)
