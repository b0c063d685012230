"""Small helpers shared by parity cases."""

from __future__ import annotations

from typing import Any

import torch


def generator(params: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(params.get("seed", 0)))


def randn(params: dict[str, Any], *shape: int, scale: float = 1.0, g=None) -> torch.Tensor:
    g = g or generator(params)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def megatron_config(**overrides: Any) -> Any:
    """A minimal TransformerConfig for building one Megatron module."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    base.update(overrides)
    return TransformerConfig(**base)


def grads(out: torch.Tensor, grad_out: torch.Tensor, **leaves: torch.Tensor | None) -> dict:
    """Back-propagate ``grad_out`` and collect ``grad_<name>`` for each non-None leaf."""
    out.backward(grad_out.to(out.dtype))
    return {f"grad_{k}": v.grad for k, v in leaves.items() if v is not None}
