"""One fused AdamW step over lists of tensors (decoupled weight decay, torch.optim.AdamW maths).

``step`` is the step number *after* this update (1 for the first step), as in
``torch.optim.AdamW`` where the state step is incremented before the update::

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g          (g = -grad with maximize)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr * (m / (1 - beta1^step)) / (sqrt(v' / (1 - beta2^step)) + eps)

with ``v' = v`` or, with amsgrad, ``v' = max_exp_avg_sq <- max(max_exp_avg_sq, v)``.

Native path: ``torch._fused_adamw_`` per (device, dtype) group. Where that kernel is missing for
the device and dtypes (found once by a one-element probe, not by catching errors of the real
update) a plain fp32 per-tensor update runs instead, and says so: a
:class:`~megatron_npu.ops.fallbacks.FusedKernelFallbackWarning` once, recorded for
``megatron-npu info`` (:mod:`megatron_npu.ops.fallbacks`).

NPU path: ``npu_apply_adam_w`` (which takes one tensor per operand) once per chunk of up to
:data:`NPU_CHUNK_ELEMENTS` elements, not once per parameter: each operand list is viewed as one
flat tensor where its tensors already lie back to back in one buffer (the moments
:class:`~megatron_npu.optim.adamw.FusedAdamW` keeps do), else gathered with one ``cat``; gathered
outputs go back with one ``_foreach_copy_``. So a step launches a handful of kernels per chunk,
whatever the parameter count. The powers passed are ``beta1**(step-1)`` and ``beta2**(step-1)``
because the op multiplies them by beta itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from megatron_npu.ops import fallbacks
from megatron_npu.ops._common import check_float_dtype
from megatron_npu.ops.kernels import npu_kernels

_OP = "adamw_step"


def _check(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    amsgrad,
) -> None:
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
        raise ValueError(
            f"{_OP}: step must be an int >= 1 (the step after this update), got {step!r}"
        )
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


_FUSED = "torch._fused_adamw_"
_fused_available: dict[tuple[str, torch.dtype, torch.dtype, torch.dtype, torch.dtype], bool] = {}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fused_adamw_available(
    device: torch.device | str,
    dtype: torch.dtype,
    grad_dtype: torch.dtype,
    exp_avg_dtype: torch.dtype | None = None,
    exp_avg_sq_dtype: torch.dtype | None = None,
) -> bool:
    """Whether ``torch._fused_adamw_`` runs for params of ``dtype``, grads of ``grad_dtype`` and
    moments of the given dtypes (default ``dtype``) on ``device``'s type: a one-element probe,
    once per combination. A missing kernel is recorded as a named fallback
    (:func:`megatron_npu.ops.fallbacks.record`)."""
    device = torch.device(device)
    m_dtype = dtype if exp_avg_dtype is None else exp_avg_dtype
    v_dtype = dtype if exp_avg_sq_dtype is None else exp_avg_sq_dtype
    key = (device.type, dtype, grad_dtype, m_dtype, v_dtype)
    if key not in _fused_available:
        p = torch.zeros(1, dtype=dtype, device=device)
        m = torch.zeros(1, dtype=m_dtype, device=device)
        v = torch.zeros(1, dtype=v_dtype, device=device)
        g = torch.zeros(1, dtype=grad_dtype, device=device)
        try:
            torch._fused_adamw_(
                [p],
                [g],
                [m],
                [v],
                [],
                [torch.ones((), device=device)],
                lr=0.0,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.0,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
            )
            _fused_available[key] = True
        except (RuntimeError, NotImplementedError) as exc:
            _fused_available[key] = False
            fallbacks.record(
                fallbacks.Fallback(
                    op=_OP,
                    kernel=_FUSED,
                    where=f"{device.type} {_name(dtype)} params, {_name(grad_dtype)} grads, "
                    f"{_name(m_dtype)}/{_name(v_dtype)} moments",
                    instead="a per-tensor fp32 AdamW update (one op chain per parameter)",
                    reason=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
            )
    return _fused_available[key]


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
    _check(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        amsgrad,
    )
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        key = (p.device, p.dtype, grads[i].dtype, exp_avgs[i].dtype, exp_avg_sqs[i].dtype)
        groups.setdefault(key, []).append(i)
    for (device, dtype, grad_dtype, m_dtype, v_dtype), idx in groups.items():
        if not fused_adamw_available(device, dtype, grad_dtype, m_dtype, v_dtype):
            for i in idx:
                _plain_adamw(
                    params[i],
                    grads[i],
                    exp_avgs[i],
                    exp_avg_sqs[i],
                    max_exp_avg_sqs[i] if amsgrad else None,
                    step,
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    maximize,
                )
            continue
        # one step tensor read by every parameter's update: the kernel takes a list, and a
        # tensor per parameter would be one host-to-device copy per parameter per step
        steps = [torch.tensor(float(step), device=device)] * len(idx)
        vmax = [max_exp_avg_sqs[i] for i in idx] if amsgrad else []
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
    _check(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        amsgrad,
    )
    beta1_power, beta2_power = beta1 ** (step - 1), beta2 ** (step - 1)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for idx in groups.values():
        for chunk in element_chunks(idx, params, NPU_CHUNK_ELEMENTS):
            p_list = [params[i] for i in chunk]
            dtype = p_list[0].dtype
            operands = {
                "var": p_list,
                "grad": [grads[i] for i in chunk],
                "m": [exp_avgs[i] for i in chunk],
                "v": [exp_avg_sqs[i] for i in chunk],
            }
            if amsgrad:
                operands["vmax"] = [max_exp_avg_sqs[i] for i in chunk]
            for name, tensors in operands.items():
                wrong = next((t.dtype for t in tensors if t.dtype != dtype), None)
                if wrong is not None:  # the kernel takes one dtype for all of them
                    raise TypeError(
                        f"{_OP}: npu_apply_adam_w needs {name} in the params' dtype "
                        f"{dtype}, got {wrong}"
                    )
            flat = {name: flat_view(tensors) for name, tensors in operands.items()}
            gathered = [name for name, view in flat.items() if view is None]
            for name in gathered:
                flat[name] = torch.cat([t.reshape(-1) for t in operands[name]])
            kernels.npu_apply_adam_w(
                beta1_power,
                beta2_power,
                lr,
                weight_decay,
                beta1,
                beta2,
                eps,
                flat["grad"],
                flat.get("vmax"),
                amsgrad,
                maximize,
                out=(flat["var"], flat["m"], flat["v"]),
            )
            if amsgrad:  # the op reads the running max but does not write it back
                torch.maximum(flat["vmax"], flat["v"], out=flat["vmax"])
            back = [name for name in gathered if name != "grad"]
            if back:
                torch._foreach_copy_(
                    [t for name in back for t in operands[name]],
                    [piece for name in back for piece in _unflatten(flat[name], operands[name])],
                )


#: Largest number of elements one ``npu_apply_adam_w`` call covers where the operands have to be
#: gathered (bounds the temporary copies); whole tensors are never split.
NPU_CHUNK_ELEMENTS = 1 << 26


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view covering ``tensors`` in order when they lie back to back (contiguous, one
    storage, one dtype, each starting where the previous ends), else None. Launches nothing."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    start = offset
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    return first.as_strided((offset - start,), (1,), start)


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    pieces = flat.split([t.numel() for t in like])
    return [piece.view(t.shape) for piece, t in zip(pieces, like, strict=True)]


def element_chunks(idx: list[int], params: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    """``idx`` cut, at tensor boundaries, into runs of at most ``limit`` elements (a larger
    tensor is a run of its own)."""
    runs: list[list[int]] = []
    size = 0
    for i in idx:
        n = params[i].numel()
        if not runs or size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += n
    return runs


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
    kwargs = dict(
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        max_exp_avg_sqs=max_exp_avg_sqs,
        amsgrad=amsgrad,
        maximize=maximize,
    )
    kernels = npu_kernels("npu_apply_adam_w")
    if kernels is not None:
        npu_adamw_step_(kernels, params, grads, exp_avgs, exp_avg_sqs, **kwargs)
    else:
        native_adamw_step_(params, grads, exp_avgs, exp_avg_sqs, **kwargs)
