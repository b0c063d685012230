"""One fused AdamW step over lists of tensors (decoupled weight decay, torch.optim.AdamW maths).

``step`` is the step number *after* this update (1 for the first step), as in
``torch.optim.AdamW`` where the state step is incremented before the update::

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g          (g = -grad with maximize)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr * (m / (1 - beta1^step)) / (sqrt(v' / (1 - beta2^step)) + eps)

with ``v' = v`` or, with amsgrad, ``v' = max_exp_avg_sq <- max(max_exp_avg_sq, v)``.

Native path: ``torch._fused_adamw_`` per (device, dtype) group (falls back to a plain fp32
per-tensor update where the fused kernel is missing). NPU path: ``npu_apply_adam_w`` per tensor,
passing ``beta1**(step-1)`` and ``beta2**(step-1)`` because the op multiplies the powers by beta
itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from megatron_npu.ops._common import check_float_dtype
from megatron_npu.ops.kernels import npu_kernels

_OP = "adamw_step"


def _check(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, lr, beta1, beta2, eps,
           weight_decay, amsgrad) -> None:
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if amsgrad:
        if max_exp_avg_sqs is None:
            raise ValueError(f"{_OP}: amsgrad=True needs max_exp_avg_sqs")
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{_OP}: {name} has {len(lst)} tensors, params has {n}")
    for i, p in enumerate(params):
        check_float_dtype(_OP, f"params[{i}]", p)
        for name, lst in lists.items():
            if lst[i].shape != p.shape:
                raise ValueError(
                    f"{_OP}: {name}[{i}] shape {tuple(lst[i].shape)} differs from params[{i}] "
                    f"{tuple(p.shape)}"
                )
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{_OP}: step must be an int >= 1 (the step after this update), got "
                         f"{step!r}")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"{_OP}: lr, eps and weight_decay must be >= 0")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{_OP}: {name} must be in [0, 1), got {b}")


def _plain_adamw(p, g, m, v, vmax, step, lr, beta1, beta2, eps, weight_decay, maximize):
    gf = -g.float() if maximize else g.float()
    mf = m.float().mul_(beta1).add_(gf, alpha=1.0 - beta1)
    vf = v.float().mul_(beta2).addcmul_(gf, gf, value=1.0 - beta2)
    second = vf
    if vmax is not None:
        second = torch.maximum(vmax.float(), vf)
        vmax.copy_(second)
    denom = (second / (1.0 - beta2**step)).sqrt_().add_(eps)
    pf = p.float().mul_(1.0 - lr * weight_decay)
    pf.addcdiv_(mf, denom, value=-lr / (1.0 - beta1**step))
    p.copy_(pf)
    m.copy_(mf)
    v.copy_(vf)


def native_adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, lr, beta1, beta2, eps,
           weight_decay, amsgrad)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype, grads[i].dtype), []).append(i)
    for (device, _, _), idx in groups.items():
        steps = [torch.tensor(float(step), device=device) for _ in idx]
        vmax = [max_exp_avg_sqs[i] for i in idx] if amsgrad else []
        try:
            torch._fused_adamw_(
                [params[i] for i in idx],
                [grads[i] for i in idx],
                [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx],
                vmax,
                steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=amsgrad,
                maximize=maximize,
            )
        except (RuntimeError, NotImplementedError):  # no fused kernel for this device/dtype
            for i in idx:
                _plain_adamw(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                             max_exp_avg_sqs[i] if amsgrad else None, step, lr, beta1, beta2,
                             eps, weight_decay, maximize)


def npu_adamw_step_(
    kernels: ModuleType,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    _check(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, lr, beta1, beta2, eps,
           weight_decay, amsgrad)
    beta1_power, beta2_power = beta1 ** (step - 1), beta2 ** (step - 1)
    for i, p in enumerate(params):
        vmax = max_exp_avg_sqs[i] if amsgrad else None
        kernels.npu_apply_adam_w(
            beta1_power,
            beta2_power,
            lr,
            weight_decay,
            beta1,
            beta2,
            eps,
            grads[i],
            vmax,
            amsgrad,
            maximize,
            out=(p, exp_avgs[i], exp_avg_sqs[i]),
        )
        if vmax is not None:  # the op reads the running max but does not write it back
            torch.maximum(vmax, exp_avg_sqs[i], out=vmax)


def adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    """In-place AdamW step on the NPU kernel module in use, else natively."""
    kwargs = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, max_exp_avg_sqs=max_exp_avg_sqs, amsgrad=amsgrad,
                  maximize=maximize)
    kernels = npu_kernels()
    if kernels is not None:
        npu_adamw_step_(kernels, params, grads, exp_avgs, exp_avg_sqs, **kwargs)
    else:
        native_adamw_step_(params, grads, exp_avgs, exp_avg_sqs, **kwargs)
