"""Planted bugs: does the parity harness catch a realistic mistake in a patched path?

Each :class:`Mutation` monkeypatches one function on the path a patch takes (an op, an op's NPU
binding, the emulated kernel, or a name a patch module imported) for the duration of a ``with``
block and restores it afterwards. :func:`planted` activates one by name; the harness does so
around ``case.run`` only (never the reference) when a :class:`~parity.harness.Job` carries
``mutation=<name>``, on every rank of a rank pool, so a bug inside a collective is planted in
every worker. ``tests/parity/test_mutations.py`` runs each mutation's job with and without the
bug and requires ``error`` only with it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from parity.case import Parallel


@contextlib.contextmanager
def _swap(target: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``module.attr`` (dotted ``target``) by ``make(original)``; put it back after."""
    module_name, _, attr = target.rpartition(".")
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, make(original))
    try:
        yield
    finally:
        setattr(module, attr, original)


@dataclass(frozen=True)
class Mutation:
    """One planted bug and the parity job that must catch it."""

    name: str
    bug: str  # what is wrong, in words
    target: str  # the dotted name that is replaced
    make: Callable[[Any], Any]  # original -> buggy replacement
    patch_id: str
    examples: tuple[dict[str, Any], ...]
    device: str = "cpu"
    dtype: str = "float32"
    parallel: Parallel = Parallel()

    def plant(self) -> contextlib.AbstractContextManager[None]:
        return _swap(self.target, self.make)

    def job(self, with_bug: bool = True) -> Any:
        from parity.harness import Job

        return Job(
            patch_id=self.patch_id, device=self.device, dtype=self.dtype,
            parallel=self.parallel, examples=self.examples,
            mutation=self.name if with_bug else None,
        )  # fmt: skip


# ---------------------------------------------------------------------------- the bugs


def _swapped_swiglu(original):
    def swiglu(x, dim=-1):
        import torch.nn.functional as F

        a, b = x.chunk(2, dim=dim)
        return F.silu(b) * a  # silu of the *second* half

    return swiglu


def _inverted_mask(original):
    def attention(query, key, value, *, attention_mask=None, **kwargs):
        if attention_mask is not None:
            attention_mask = ~attention_mask.bool()  # True read as "keep"
        return original(query, key, value, attention_mask=attention_mask, **kwargs)

    return attention


def _kernel_default_scale(original):
    def npu_fusion_attention(*args, scale=1.0, **kwargs):
        return original(*args, scale=1.0, **kwargs)  # Megatron's softmax scale not passed on

    return npu_fusion_attention


def _softmax_without_scale(original):
    def scaled_masked_softmax(x, mask=None, scale=1.0, causal=False):
        return original(x, mask, 1.0, causal)

    return scaled_masked_softmax


def _softmax_inverted_mask(original):
    def scaled_masked_softmax(x, mask=None, scale=1.0, causal=False):
        return original(x, None if mask is None else ~mask, scale, causal)

    return scaled_masked_softmax


def _rms_norm_eps(wrong_eps):
    def make(original):
        def rms_norm(x, weight, eps=1e-6):
            return original(x, weight, wrong_eps)

        return rms_norm

    return make


def _rms_norm_bf16_statistics(original):
    def rms_norm(x, weight, eps=1e-6):
        import torch

        dims = tuple(range(x.dim() - weight.dim(), x.dim()))
        xb = x.to(torch.bfloat16)  # mean(x^2) accumulated and kept in bf16
        rstd = torch.rsqrt(xb.pow(2).mean(dim=dims, keepdim=True) + eps).float()
        return (x.float() * rstd * weight.float()).to(x.dtype), rstd

    return rms_norm


def _no_sum_all_reduce(original):
    def dist_reduce(op, group):
        import torch.distributed as dist

        if op == dist.ReduceOp.SUM:
            return lambda t: t  # the SUM all-reduces (target logit, sum of exp) dropped
        return original(op, group)

    return dist_reduce


def _rotate_other_mode(original):
    def rotate(x, mode="half"):
        return original(x, "interleave" if mode == "half" else "half")

    return rotate


def _not_unscaled(original):
    def check_finite_and_unscale_(tensors, inv_scale):
        return original(tensors, 1.0)  # inf check done, loss scale left in the grads

    return check_finite_and_unscale_


def _adamw_no_bias_correction(original):
    def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.01, max_exp_avg_sqs=None, amsgrad=False,
                    maximize=False):  # fmt: skip
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            p.mul_(1.0 - lr * weight_decay)
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)  # no 1/(1 - beta**step)

    return adamw_step_


def _l2norm_without_sqrt(original):
    def multi_tensor_l2norm(tensors, per_tensor=False):
        total, per = original(tensors, per_tensor=per_tensor)
        return total**2, (None if per is None else per**2)  # sums of squares

    return multi_tensor_l2norm


# ---------------------------------------------------------------------------- examples

_SWIGLU = {"seq": 4, "batch": 2, "hidden": 64, "bias": True, "scale": 1.0, "seed": 1}
_ATTENTION = {
    "layout": "SBH", "mask": "causal", "pre": 65536, "next": 65536, "seq": 32, "kv_seq": 32,
    "batch": 2, "heads": 4, "groups": 2, "head_dim": 16, "qk_scale": 1.0, "softmax_scale": None,
    "layer_scaling": False, "layer_number": 1, "seed": 11,
}  # fmt: skip
_ATTENTION_PADDING = {**_ATTENTION, "layout": "BSH", "mask": "padding", "seq": 24, "kv_seq": 24,
                      "heads": 2, "seed": 15}  # fmt: skip
_SOFTMAX = {"batch": 2, "heads": 2, "sq": 64, "sk": 64, "x_scale": 1.0, "seed": 1}
_RMS_TINY = {"normalization": "RMSNorm", "seq": 4, "batch": 2, "hidden": 64, "scale": 1e-3,
             "eps": 1e-6, "seed": 1}  # fmt: skip
_RMS = {**_RMS_TINY, "scale": 1.0, "eps": 1e-5, "seed": 7}
_CROSS_ENTROPY = {"seq": 4, "batch": 2, "vocab": 256, "label_smoothing": 0.0, "logit_scale": 1.0,
                  "seed": 1}  # fmt: skip
_ROTARY = {"seq": 16, "batch": 2, "heads": 2, "head_dim": 32, "rot_dim": 32,
           "interleaved": False, "mla": False, "mscale": 1.0, "seed": 1}  # fmt: skip
_UNSCALE = {"tensors": 5, "loss_scale": 2.0**16, "plant": "none", "plant_rank": 0, "seed": 1}
_ADAMW = {"tensors": 5, "steps": 3, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
          "weight_decay": 0.1, "amsgrad": False, "grad_scale": 1.0, "seed": 1}  # fmt: skip
_GRAD_NORM = {"tensors": 5, "scale": 1.0, "seed": 1}


_ALL = (
    Mutation(
        "swiglu-swapped-halves", "SwiGLU gates with the second half: silu(b) * a",
        "megatron_npu.ops.swiglu.native_swiglu", _swapped_swiglu,
        "activation.bias-swiglu", (_SWIGLU,),
    ),
    Mutation(
        "attention-mask-inverted", "the fused attention reads the padding mask as True = keep",
        "megatron_npu.ops.attention.native_fused_attention", _inverted_mask,
        "attention.dot-product", (_ATTENTION_PADDING,),
    ),
    Mutation(
        "attention-scale-dropped", "the NPU binding does not pass the softmax scale, so the "
        "kernel uses its default 1.0 instead of 1/sqrt(d)",
        "megatron_npu.testing.torch_npu_emulation.npu_fusion_attention", _kernel_default_scale,
        "attention.dot-product", (_ATTENTION,), device="npu-emulated",
    ),
    Mutation(
        "softmax-scale-dropped", "the fused softmax ignores FusedScaleMaskSoftmax.scale",
        "megatron_npu.ops.softmax.scaled_masked_softmax", _softmax_without_scale,
        "softmax.fused", ({**_SOFTMAX, "mask": "causal", "scale": 3.0},),
    ),
    Mutation(
        "softmax-mask-inverted", "the fused softmax masks the positions the mask keeps",
        "megatron_npu.ops.softmax.scaled_masked_softmax", _softmax_inverted_mask,
        "softmax.fused", ({**_SOFTMAX, "mask": "padding", "scale": None, "seed": 2},),
    ),
    Mutation(
        "rmsnorm-wrong-eps", "RMSNorm uses eps 1e-2 instead of the configured one",
        "megatron_npu.ops.norm.native_rms_norm", _rms_norm_eps(1e-2),
        "norm.wrapped-torch-norm", (_RMS_TINY,),
    ),
    Mutation(
        "rmsnorm-bf16-statistics", "RMSNorm computes mean(x^2) in bf16 in an fp32 model",
        "megatron_npu.ops.norm.native_rms_norm", _rms_norm_bf16_statistics,
        "norm.wrapped-torch-norm", (_RMS,),
    ),
    Mutation(
        "cross-entropy-tp-sum-dropped", "vocab-parallel cross entropy skips its SUM all-reduces "
        "over the tensor-parallel group",
        "megatron_npu.ops.cross_entropy._dist_reduce", _no_sum_all_reduce,
        "cross-entropy.vocab-parallel", (_CROSS_ENTROPY,), parallel=Parallel(tp=2),
    ),
    Mutation(
        "rotary-wrong-mode", "rotary rotates interleaved pairs where Megatron rotates halves",
        "megatron_npu.ops.rotary.rotate", _rotate_other_mode,
        "rotary.apply-bshd", (_ROTARY,),
    ),
    Mutation(
        "loss-scale-not-unscaled", "the inf check runs but the grads keep the loss scale",
        "megatron_npu.patches.optimizer.check_finite_and_unscale_", _not_unscaled,
        "optimizer.unscale-and-check-nan", (_UNSCALE,),
    ),
    Mutation(
        "adamw-bias-correction-dropped", "AdamW without the 1/(1 - beta**step) corrections",
        "megatron_npu.ops.adamw.native_adamw_step_", _adamw_no_bias_correction,
        "optimizer.adam", (_ADAMW,),
    ),
    Mutation(
        "grad-norm-missing-sqrt", "the l2-norm kernel returns sums of squares (TP2: Megatron "
        "all-reduces their squares)",
        "megatron_npu.patches.optimizer.multi_tensor_l2norm", _l2norm_without_sqrt,
        "optimizer.l2-norm", (_GRAD_NORM,), parallel=Parallel(tp=2),
    ),
)  # fmt: skip

MUTATIONS: dict[str, Mutation] = {m.name: m for m in _ALL}


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """The bug ``name`` is in place inside the block, gone after it."""
    try:
        mutation = MUTATIONS[name]
    except KeyError:
        raise KeyError(f"no mutation {name!r}; known: {sorted(MUTATIONS)}") from None
    with mutation.plant():
        yield
