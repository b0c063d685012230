"""A fused AdamW for Megatron: same constructor and state layout as ``torch.optim.AdamW``.

Megatron picks apex/TE ``FusedAdam`` on CUDA and falls back to ``torch.optim.AdamW`` elsewhere;
this class keeps torch's state keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
and parameter-group options, so checkpoints and Megatron's distributed optimizer see no
difference, and performs each group's update through :func:`megatron_npu.ops.adamw.adamw_step_`
(``npu_apply_adam_w`` on the NPU, ``torch._fused_adamw_`` natively).

The moments of a parameter group live back to back in one flat buffer per device and dtype
(each state entry is a view of it), so the NPU path hands them to the kernel as single tensors;
moments that arrive otherwise (a loaded checkpoint) are packed on the next step.

Parameters that are DTensors (PyTorch FSDP2, ``--use-torch-fsdp2``) keep DTensor moments of the
same mesh and placements, so checkpoints shard them as the parameters; the update runs on each
rank's shards, whose moments lie back to back in the flat buffer as any other's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from megatron_npu.ops.adamw import adamw_step_, flat_view

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (it shares the DTensor's storage); any other tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``p`` holds its values: a DTensor of ``p``'s mesh and placements whose shard
    is ``local`` when ``p`` is one, else ``local`` itself."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def hyperparameters(group: dict[str, Any]) -> dict[str, float]:
    """A parameter group's AdamW settings as :func:`adamw_step_` takes them."""
    beta1, beta2 = (float(b) for b in group["betas"])
    return {
        "lr": float(group["lr"]),
        "beta1": beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
    }


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with its update done by the op layer.

    A subclass, so every ``isinstance(optimizer, torch.optim.AdamW)`` check in Megatron (the
    distributed optimizer accepts only Adam-like optimizers, and lays out checkpoint state by
    that test) keeps holding.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[dict[str, Any]]
        | Iterable[tuple[str, torch.Tensor]],
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
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=None,
        )

    def _pack_moments(self, params: list[torch.Tensor], amsgrad: bool) -> None:
        """Give ``params`` (one group's, with grads) their moments as views of one flat buffer
        per device and dtype: zeros when new, the current values when they are not already
        back to back. Launches nothing when they already are."""
        keys = _MOMENTS if amsgrad else _MOMENTS[:2]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        for same in by_kind.values():
            for key in keys:
                current = [self.state[p].get(key) for p in same]
                if all(t is not None for t in current) and (
                    flat_view([_local(t) for t in current]) is not None
                ):
                    continue
                shards = [_local(p) for p in same]
                flat = torch.zeros(
                    sum(s.numel() for s in shards), dtype=same[0].dtype, device=shards[0].device
                )
                offset = 0
                for p, shard, old in zip(same, shards, current, strict=True):
                    view = flat[offset : offset + shard.numel()].view(shard.shape)
                    if old is not None:
                        view.copy_(_local(old))
                    self.state[p][key] = _like(p, view)
                    offset += shard.numel()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        """One parameter group's update."""
        amsgrad = group["amsgrad"]
        by_step: dict[int, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
        with_grad = [p for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in with_grad):
            raise RuntimeError("FusedAdamW does not support sparse gradients")
        self._pack_moments(with_grad, amsgrad)
        for p in with_grad:
            state = self.state[p]
            state["step"] += 1
            by_step.setdefault(int(state["step"].item()), []).append((p, state))
        for step, items in by_step.items():
            adamw_step_(
                [_local(p) for p, _ in items],
                [_local(p.grad) for p, _ in items],
                [_local(s["exp_avg"]) for _, s in items],
                [_local(s["exp_avg_sq"]) for _, s in items],
                step=step,
                **hyperparameters(group),
                max_exp_avg_sqs=[_local(s["max_exp_avg_sq"]) for _, s in items]
                if amsgrad
                else None,
                amsgrad=amsgrad,
                maximize=group["maximize"],
            )
