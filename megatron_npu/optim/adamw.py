"""A fused AdamW for Megatron: same constructor and state layout as ``torch.optim.AdamW``.

Megatron picks apex/TE ``FusedAdam`` on CUDA and falls back to ``torch.optim.AdamW`` elsewhere;
this class keeps torch's state keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
and parameter-group options, so checkpoints and Megatron's distributed optimizer see no
difference, and performs each group's update through :func:`megatron_npu.ops.adamw.adamw_step_`
(``npu_apply_adam_w`` on the NPU, ``torch._fused_adamw_`` natively).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_npu.ops.adamw import adamw_step_


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with its update done by the op layer.

    A subclass, so every ``isinstance(optimizer, torch.optim.AdamW)`` check in Megatron (the
    distributed optimizer accepts only Adam-like optimizers, and lays out checkpoint state by
    that test) keeps holding.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float | torch.Tensor = 0.001,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-08,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if capturable or differentiable:
            raise ValueError("FusedAdamW: capturable/differentiable are not supported")
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=False, differentiable=False,
            fused=None,
        )  # fmt: skip

    def _state_of(self, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            amsgrad = group["amsgrad"]
            by_step: dict[int, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                state = self._state_of(p, amsgrad)
                state["step"] += 1
                by_step.setdefault(int(state["step"].item()), []).append((p, state))
            beta1, beta2 = (float(b) for b in group["betas"])
            for step, items in by_step.items():
                adamw_step_(
                    [p for p, _ in items], [p.grad for p, _ in items],
                    [s["exp_avg"] for _, s in items], [s["exp_avg_sq"] for _, s in items],
                    step=step, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    max_exp_avg_sqs=[s["max_exp_avg_sq"] for _, s in items] if amsgrad else None,
                    amsgrad=amsgrad, maximize=group["maximize"],
                )  # fmt: skip
        return loss
