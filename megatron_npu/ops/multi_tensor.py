"""Multi-tensor helpers replacing apex/amp_C's ``multi_tensor_l2norm`` / ``multi_tensor_scale``
and the AMP unscale, on torch's foreach ops.

``torch._foreach_norm`` and ``torch._amp_foreach_non_finite_check_and_unscale_`` are aten ops
that torch_npu registers for the NPU, so one implementation serves every device; there is no
``torch_npu`` namespace call and hence no separate NPU binding in this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_npu.ops._common import check_float_dtype


def _check(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        check_float_dtype(op, f"{name}[{i}]", t)


def multi_tensor_l2norm(
    tensors: Sequence[torch.Tensor], per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(total, per)``: the fp32 L2 norm of all tensors together (shape ``(1,)``, as amp_C
    returns it) and, with ``per_tensor``, the fp32 norm of each tensor (shape ``(n,)``)."""
    _check("multi_tensor_l2norm", "tensors", tensors)
    tensors = list(tensors)
    if not tensors:
        zero = torch.zeros(1, dtype=torch.float32)
        return zero, (torch.zeros(0, dtype=torch.float32) if per_tensor else None)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"multi_tensor_l2norm: tensors must share one device, got {devices}")
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    per = torch.stack(norms)
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, (per if per_tensor else None)


def check_finite_and_unscale_(
    tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor | float
) -> torch.Tensor:
    """Multiply every tensor by ``inv_scale`` in place; return a fp32 ``(1,)`` tensor that is 1
    if any element (before scaling) was inf/nan, else 0."""
    _check("check_finite_and_unscale_", "tensors", tensors)
    tensors = list(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if not tensors:
        return found_inf
    if torch.is_tensor(inv_scale):
        inv = inv_scale.to(device=device, dtype=torch.float32).reshape(1)
    else:  # filled on the device: a host scalar copied there would wait for the device
        inv = torch.full((1,), float(inv_scale), dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
    return found_inf


def multi_tensor_scale_(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """amp_C ``multi_tensor_scale``: ``dst[i] = src[i] * scale`` (src may be dst, as Megatron's
    grad clipping passes ``[grads, grads]``). Returns the fp32 ``(1,)`` non-finite flag."""
    op = "multi_tensor_scale_"
    _check(op, "src", src)
    _check(op, "dst", dst)
    if len(src) != len(dst):
        raise ValueError(f"{op}: src has {len(src)} tensors, dst has {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if s.shape != d.shape:
            raise ValueError(
                f"{op}: src[{i}] shape {tuple(s.shape)} differs from dst[{i}] {tuple(d.shape)}"
            )
    copies = [(s, d) for s, d in zip(src, dst, strict=True) if s is not d]
    if copies:
        torch._foreach_copy_([d for _, d in copies], [s for s, _ in copies])
    return check_finite_and_unscale_(dst, scale)
