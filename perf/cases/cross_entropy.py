"""Vocab-parallel cross entropy at TP1: Megatron's in-place ``_VocabParallelCrossEntropy`` vs the
op layer's fused op. Vocab 128k, 1024 tokens. The logits are a fresh activation per call (a clone
of fixed logits, as the output layer hands them over), so Megatron's in-place work and ours
start from the same state; the clone is part of every path's time and memory."""

from __future__ import annotations

import torch

from perf.case import BenchCase, Built, Cell, implementation


def build(cell: Cell) -> Built:
    s, b, v = (cell.shape[k] for k in ("seq", "batch", "vocab"))
    gen = torch.Generator().manual_seed(0)
    grad = cell.direction == "fwd+bwd"
    base = (torch.randn(s, b, v, generator=gen) * 2).to(cell.torch_dtype).requires_grad_(grad)
    target = torch.randint(0, v, (s, b), generator=gen)
    loss_fn = implementation(cell)
    # a new logits activation each call (clone: its backward hands the gradient through as is)
    return Built(lambda: loss_fn(base.clone(), target), (base,) if grad else ())


VOCAB_PARALLEL_CROSS_ENTROPY = BenchCase(
    op="cross-entropy",
    shapes={
        "full": {"seq": 1024, "batch": 1, "vocab": 131072},
        "quick": {"seq": 128, "batch": 1, "vocab": 32768},
    },
    build=build,
    paths=("megatron", "native"),
    note="no torch_npu kernel: the op is the same code on every device (no npu-binding path)",
)
