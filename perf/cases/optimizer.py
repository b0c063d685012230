"""Optimizer kernels on the parameters of a small GPT's worth of fp32 main weights (24 tensors
of 1024 x 1024, 25M elements; Megatron keeps fp32 main params and grads for bf16 training, so
these run in fp32), and the precision-aware optimizer's step on the same count of bf16
parameters. Direction ``step``: one call.

``megatron`` is what Megatron binds without apex/TE: ``torch.optim.AdamW`` (torch's default,
the foreach implementation), ``torch._amp_foreach_non_finite_check_and_unscale_`` for the
unscale, and ``local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale`` for the grad norm
and clip scale (run on the CPU through the adaptor's device routing).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from perf.case import BenchCase, Built, Cell, implementation


def _tensors(cell: Cell, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, side = cell.shape["tensors"], cell.shape["side"]
    return [torch.randn(side, side, generator=gen) for _ in range(n)]


def _adamw(cell: Cell) -> Built:
    params = [torch.nn.Parameter(t) for t in _tensors(cell, 0)]
    for p, g in zip(params, _tensors(cell, 1), strict=True):
        p.grad = g
    cls = implementation(cell)
    opt = (
        cls(params, lr=1e-4, weight_decay=0.1, foreach=True)
        if cell.path == "megatron"
        else cls(params, lr=1e-4, weight_decay=0.1)
    )
    return Built(opt.step)


def _precision_aware(cell: Cell) -> Built:
    """One optimizer step over bf16 parameters. ``megatron``: what Megatron steps without
    ``--use-precision-aware-optimizer``, fp32 main params and grads through torch's AdamW, then
    the copy into the bf16 model params; otherwise the precision-aware optimizer with the
    memory-saving recipe (bf16 grads and moments, the master as bf16 params + int16
    remainders)."""
    from megatron_npu.optim.precision_aware import MegatronAdam

    model = [t.bfloat16() for t in _tensors(cell, 0)]
    grads = [t.bfloat16() for t in _tensors(cell, 1)]
    if cell.path == "megatron":
        main = [torch.nn.Parameter(t.float()) for t in model]
        for p, g in zip(main, grads, strict=True):
            p.grad = g.float()
        opt = torch.optim.AdamW(main, lr=1e-4, weight_decay=0.1, foreach=True)

        def step() -> None:
            opt.step()
            torch._foreach_copy_(model, main)

        return Built(step)
    params = [torch.nn.Parameter(t) for t in model]
    for p, g in zip(params, grads, strict=True):
        p.decoupled_grad = g
    opt = MegatronAdam(
        params,
        lr=1e-4,
        weight_decay=0.1,
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        use_decoupled_grad=True,
        store_param_remainders=True,
    )
    return Built(opt.step)


class _UnscaleOwner:
    """The attributes ``_unscale_main_grads_and_check_for_nan`` reads."""

    def __init__(self, grads):
        import torch.distributed as dist

        self._grads = grads
        self.found_inf = torch.zeros(1)
        self.grad_scaler = SimpleNamespace(inv_scale=torch.tensor([1.0 / 1024]))
        self.is_stub_optimizer = False
        self._group = dist.group.WORLD

    def _collect_main_grad_data_for_unscaling(self):
        return self._grads

    def get_grad_stats_parallel_group(self):
        return self._group


def _unscale(cell: Cell) -> Built:
    owner, method = _UnscaleOwner(_tensors(cell, 1)), implementation(cell)
    return Built(lambda: method(owner))


def _l2_norm(cell: Cell) -> Built:
    grads, fn = _tensors(cell, 1), implementation(cell)
    flag = torch.zeros(1, dtype=torch.int)
    return Built(lambda: fn(2048 * 32, flag, [grads], True))


def _scale(cell: Cell) -> Built:
    src, fn = _tensors(cell, 1), implementation(cell)
    dst = [torch.empty_like(t) for t in src]
    flag = torch.zeros(1, dtype=torch.int)
    return Built(lambda: fn(2048 * 32, flag, [src, dst], 0.5))


_SHAPES = {"full": {"tensors": 24, "side": 1024}, "quick": {"tensors": 24, "side": 128}}


def _case(
    op: str, build, paths=("megatron", "native", "npu-binding"), dtype="float32"
) -> BenchCase:
    return BenchCase(
        op=op, shapes=_SHAPES, build=build, dtypes=(dtype,), directions=("step",), paths=paths
    )


_NO_KERNEL = ("megatron", "native")  # no torch_npu kernel: the op layer's torch code everywhere
ADAMW = _case("adamw", _adamw)
PRECISION_AWARE_ADAMW = _case("precision-aware-adamw", _precision_aware, dtype="bfloat16")
UNSCALE_AND_CHECK = _case("unscale-and-check", _unscale, _NO_KERNEL)
L2_NORM = _case("grad-l2-norm", _l2_norm, _NO_KERNEL)
MULTI_TENSOR_SCALE = _case("grad-scale", _scale, _NO_KERNEL)
