"""TTrace's gradient bound, as Megatron's own tests adopted it, applied to a located step.

Megatron-LM's checkpoint-consistency test (``tests/functional_tests/python_test_utils/
test_optimizer_grads_match.py``) compares the gradients two parallel layouts feed the optimizer
after one step from the same checkpoint. Each tensor's relative gradient difference
``||g - g_ref||_F / (||g_ref||_F + 1e-30)`` must stay within TTrace's bound

    k * C ** (L + 1 - l) * eps(dtype),   k = 4, C = 1.03,

``L`` the number of layers and ``l`` the tensor's layer (``eps`` is the dtype's machine epsilon:
2**-7 for bf16, 2**-10 for fp16, 2**-23 for fp32). The bound is loosest for the earliest layers,
whose gradients have passed through the most backward steps. Megatron's gate calls it with
``l = 0`` for every tensor (for a 32-layer bf16 model: 4 * 1.03**33 / 128 = 8.3 %); here each
parameter gets its own layer (0 for the embedding, ``N + 1`` inside layer ``N``, ``L + 1`` after
the layers), the bound as TTrace states it.

It is one global yardstick per tensor, with no view of where an error entered; locate's
input-explained rule (:mod:`.modules`) judges each module by what its inputs explain. Run on the
same replayed step, the two answer different questions: does any gradient leave the bound (a
yes/no for the step), and which module made the error (a name). docs/locate.md compares what each
catches on the planted-bug sweep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

K = 4.0
C = 1.03

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bound(dtype: str, layer: int, num_layers: int, k: float = K, c: float = C) -> float:
    """``k * c**(num_layers + 1 - layer) * eps(dtype)``."""
    eps = torch.finfo(_DTYPES.get(dtype, torch.float32)).eps
    return k * c ** (num_layers + 1 - layer) * eps


@dataclass(frozen=True)
class GradientCheck:
    """One parameter's gradient against its bound."""

    parameter: str
    layer: int
    error: float
    bound: float

    @property
    def exceeds(self) -> bool:
        return not self.error <= self.bound  # an infinite or NaN error exceeds

    def as_dict(self) -> dict[str, Any]:
        error = self.error if math.isfinite(self.error) else "Infinity"
        return {
            "parameter": self.parameter,
            "layer": self.layer,
            "error": error,
            "bound": self.bound,
            "exceeds": self.exceeds,
        }


def judge(grads: list[tuple[str, int, float]], num_layers: int, dtype: str) -> dict[str, Any]:
    """The bound's verdict on one step: ``grads`` holds (parameter, layer, relative gradient
    error) for every parameter gradient of the step's dumps."""
    checks = [
        GradientCheck(p, layer, err, bound(dtype, layer, num_layers)) for p, layer, err in grads
    ]
    over = [c for c in checks if c.exceeds]
    worst = max(checks, key=lambda c: c.error / c.bound if c.bound else math.inf, default=None)
    return {
        "rule": f"relative gradient error <= {K:g} * {C:g}**(L + 1 - l) * eps({dtype})",
        "num_layers": num_layers,
        "dtype": dtype,
        "parameters": len(checks),
        "caught": bool(over),
        "exceeding": [c.as_dict() for c in over],
        "worst": worst.as_dict() if worst else None,
    }
