"""Planted bugs: does the parity harness catch a realistic mistake in a patched path?

Each :class:`Mutation` monkeypatches one function on the path a patch takes (an op, an op's NPU
binding, the emulated kernel, or a name a patch module imported) for the duration of a ``with``
block and restores it afterwards. :func:`planted` activates one by name; the harness does so
around ``case.run`` only (never the reference) when a :class:`~megatron_npu.parity.harness.Job`
carries ``mutation=<name>``, on every rank of a rank pool, so a bug inside a collective is planted
in every worker. ``tests/parity/test_mutations.py`` runs each mutation's job with and without the
bug and requires ``error`` only with it.

The harness imports this module (never the reverse):
:func:`megatron_npu.parity.harness.mutation_job` builds a mutation's job and
:func:`megatron_npu.parity.harness.evaluate_mutation` runs it.

A mutation with ``scope="job"`` is planted around the whole in-process evaluation instead (it
changes the case itself, e.g. a reference that calls the patched implementation).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_npu.parity.case import Parallel

from megatron_npu.devices.facts import CPU, NPU_EMULATED


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
    device: str = CPU
    dtype: str = "float32"
    parallel: Parallel = Parallel()
    #: "run": planted around ``case.run`` by the harness (every rank); "job": around the whole
    #: in-process evaluation (world size 1 only)
    scope: str = "run"

    def __post_init__(self) -> None:
        if self.scope not in ("run", "job"):
            raise ValueError(f"mutation {self.name!r}: scope must be 'run' or 'job'")
        if self.scope == "job" and self.parallel.world > 1:
            raise ValueError(f"mutation {self.name!r}: a job-scope bug runs in-process only")

    def plant(self) -> contextlib.AbstractContextManager[None]:
        return _swap(self.target, self.make)


# ---------------------------------------------------------------------------- the bugs


def _wgrad_in_input_dtype(original):
    def _wgrad_fp32(total_input, grad_output):
        import torch

        # the GEMM in the activations' dtype, only its result upcast: no fp32 accumulation
        return (grad_output.t() @ total_input).to(torch.float32)

    return _wgrad_fp32


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


def _upstream_grad_ignored(original):
    def softmax_to_grad(softmax, local_target, outside, upstream, smoothing, vocab):
        # the gradient as if every token's upstream gradient were 1
        return original(softmax, local_target, outside, upstream * 0 + 1, smoothing, vocab)

    return softmax_to_grad


def _not_regrouped(original):
    """Multi-latent attention's rotation by halves of the features as they come, without the
    even/odd regrouping."""
    from megatron_npu.ops.rotary import rotate

    def regrouped_rotary(x, cos, sin):
        xf = x.float()
        return (xf * cos.float() + rotate(xf, "half") * sin.float()).to(x.dtype)

    return regrouped_rotary


def _padded_in_front(original):
    """q/k/v brought to one head width with the zeros in front: the output's first columns,
    which the caller keeps, are then the padding's."""
    import torch

    def one_head_dim(query, key, value):
        width = max(query.shape[-1], value.shape[-1])

        def padded(t):
            extra = width - t.shape[-1]
            return t if extra == 0 else torch.nn.functional.pad(t, (extra, 0))

        return padded(query), padded(key), padded(value), value.shape[-1]

    return one_head_dim


def _rotate_other_mode(original):
    def rotate(x, mode="half"):
        return original(x, "interleave" if mode == "half" else "half")

    return rotate


def _not_unscaled(original):
    def check_finite_and_unscale_(tensors, inv_scale):
        return original(tensors, 1.0)  # inf check done, loss scale left in the grads

    return check_finite_and_unscale_


def _adamw_with_update(update):
    """A plain AdamW step (decoupled weight decay, both moments) that ends in ``update``."""

    def plant(original):
        def adamw_step_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            *,
            step,
            lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            max_exp_avg_sqs=None,
            amsgrad=False,
            maximize=False,
        ):
            for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
                p.mul_(1.0 - lr * weight_decay)
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                update(p, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps)

        return adamw_step_

    return plant


def _update_without_bias_correction(p, m, v, *, step, lr, beta1, beta2, eps):
    p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)  # no 1/(1 - beta**step)


def _update_eps_inside_sqrt(p, m, v, *, step, lr, beta1, beta2, eps):
    m_hat = m / (1.0 - beta1**step)
    v_hat = v / (1.0 - beta2**step)
    p.addcdiv_(m_hat, (v_hat + eps).sqrt(), value=-lr)  # eps inside the root


_adamw_no_bias_correction = _adamw_with_update(_update_without_bias_correction)
_adamw_eps_inside_sqrt = _adamw_with_update(_update_eps_inside_sqrt)


def _l2norm_without_sqrt(original):
    def multi_tensor_l2norm(tensors, per_tensor=False):
        total, per = original(tensors, per_tensor=per_tensor)
        return total**2, (None if per is None else per**2)  # sums of squares

    return multi_tensor_l2norm


def _adamw_lr_ten_percent_high(original):
    def adamw_step_(*args, lr, **kwargs):
        return original(*args, lr=lr * 1.1, **kwargs)  # every update 10 % too large

    return adamw_step_


def _remainder_dropped(original):
    def split_master(master):
        param, remainder = original(master)
        return param, remainder.new_zeros(remainder.shape)  # the low half is never stored

    return split_master


def _l2norm_16bit_accumulation(original):
    """The fp32 accumulator dropped for 16-bit tensors: each tensor's squares are summed one
    after another in the tensor's own dtype (fp32 tensors take the right path, unchanged)."""

    def multi_tensor_l2norm(tensors, per_tensor=False):
        import torch

        tensors = list(tensors)
        if all(t.dtype == torch.float32 for t in tensors):
            return original(tensors, per_tensor=per_tensor)
        norms = []
        for t in tensors:
            acc = torch.zeros((), dtype=t.dtype, device=t.device)
            for square in (t * t).flatten():
                acc = acc + square  # rounded to t.dtype at every step
            norms.append(acc.float().sqrt())
        per = torch.stack(norms)
        total = torch.linalg.vector_norm(per).reshape(1)
        return total, (per if per_tensor else None)

    return multi_tensor_l2norm


def _band_kernel_window_narrowed(original):
    """The C++ band forward called with the window's far end one key nearer."""

    def band_attention_forward(query, key, value, lo, hi, scale):
        return original(query, key, value, lo + 1, hi, scale)

    return band_attention_forward


def _windowed_off_by_one(original):
    """``_windowed`` with each query block's first key one too far right."""

    def windowed(q, k, v, user_visible, offset, lo, hi, block, scale, dropout_p, gqa):
        import torch

        from megatron_npu.ops.attention import native as ops

        sq, skv = q.shape[2], k.shape[2]
        outs = []
        for q0 in range(0, sq, block):
            q1 = min(sq, q0 + block)
            k0 = max(0, q0 + offset + lo + 1)  # off by one: should be q0 + offset + lo
            k1 = min(skv, q1 - 1 + offset + hi + 1)
            visible = ops.visible_keys(q0, q1, k0, k1, offset, lo, hi, q.device)
            if user_visible is not None:
                visible = visible & user_visible[..., q0:q1, k0:k1]
            outs.append(
                ops._sdpa(
                    q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], visible, scale, dropout_p, gqa
                )
            )
        return torch.cat(outs, dim=2)

    return windowed


def _dropout_in_eval(original):
    def fused_core_attention(module, *args, **kwargs):
        was = module.training
        module.train(True)  # the dropout probability read without looking at eval mode
        try:
            return original(module, *args, **kwargs)
        finally:
            module.train(was)

    return fused_core_attention


def _dropout_rate_halved(original):
    def fused_attention(*args, dropout_p=0.0, **kwargs):
        return original(*args, dropout_p=dropout_p / 2, **kwargs)

    return fused_attention


def _kernel_dropout_not_rescaled(original):
    def npu_fusion_attention(*args, keep_prob=1.0, **kwargs):
        out = original(*args, keep_prob=keep_prob, **kwargs)
        return (out[0] * keep_prob, *out[1:])  # kept probabilities not divided by keep_prob

    return npu_fusion_attention


def _rms_norm_bf16_eps(original):
    def rms_norm(x, weight, eps=1e-6):
        import torch

        if x.dtype == torch.bfloat16:  # the bf16 branch reads the wrong epsilon
            eps = 1e-2
        return original(x, weight, eps)

    return rms_norm


def _norm_option_dropped(option):
    def make(original):
        def from_megatron_config(config, hidden_size, eps):
            norm = original(config, hidden_size, eps)
            if option == "zero_centered_gamma":
                norm.zero_centered_gamma = False
            else:
                for param in norm.parameters():
                    param.sequence_parallel = False
            return norm

        return from_megatron_config

    return make


def _rotate_wrong_sign(original):
    def rotate(x, mode="half"):
        return -original(x, mode)  # (x2, -x1) instead of (-x2, x1)

    return rotate


def _kernel_r1_r2_swapped(original):
    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):  # noqa: A002
        return original(input, r2, r1, rotary_mode=rotary_mode)

    return npu_rotary_mul


def _causal_mask_with_diagonal(original):
    def causal_mask(sq, sk, device):
        import torch

        return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(diagonal=0)

    return causal_mask


def _swiglu_bias_half_dropped(original):
    def bias_swiglu(x, bias, dim=-1):
        import torch

        if bias is not None:  # the bias reaches only the second (linear) half
            half = bias.shape[-1] // 2
            bias = torch.cat((bias[..., :half] * 0, bias[..., half:]), dim=-1)
        return original(x, bias, dim=dim)

    return bias_swiglu


def _gelu_exact(original):
    def bias_gelu(x, bias, approximate="tanh"):
        return original(x, bias, approximate="none")  # erf GELU where Megatron fuses tanh

    return bias_gelu


def _shard_offset_off_by_one(original):
    def vocab_parallel_cross_entropy(logits, target, *, vocab_start_index, **kwargs):
        start = vocab_start_index + 1 if vocab_start_index > 0 else 0
        return original(logits, target, vocab_start_index=start, **kwargs)

    return vocab_parallel_cross_entropy


def _nan_not_flagged(original):
    def check_finite_and_unscale_(tensors, inv_scale):
        import torch

        for t in tensors:
            torch.nan_to_num_(t, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        return original(tensors, inv_scale)

    return check_finite_and_unscale_


def _scale_squared(original):
    def multi_tensor_scale_(src, dst, scale):
        return original(src, dst, scale * scale)

    return multi_tensor_scale_


def _sample_offsets_late(original):
    def build(*args, **kwargs):
        out = original(*args, **kwargs)
        out[1:, 1] += 1  # every sample boundary one token late
        return out

    return build


def _te_norm_zero_centered_ignored(original):
    def normalize(x, weight, bias, normalization, eps, zero_centered_gamma):
        return original(x, weight, bias, normalization, eps, False)  # gamma = w, not 1 + w

    return normalize


def _te_norm_eps_fixed(original):
    def normalize(x, weight, bias, normalization, eps, zero_centered_gamma):
        return original(x, weight, bias, normalization, 1e-2, zero_centered_gamma)

    return normalize


def _te_attention_kwarg_dropped(name):
    def make(original):
        def accepted(cls, kwargs):
            return {k: v for k, v in original(cls, kwargs).items() if k != name}

        return accepted

    return make


def _reference_calls_implementation(case):
    """The rotary case with a reference that calls the patched function itself: the
    comparison then agrees with any bug, so only a harness check can catch it."""
    import dataclasses

    def reference(ctx, inputs):
        import torch
        from megatron.core.models.common.embeddings import rope_utils

        p = ctx.params
        # the implementation in the tested dtype, its results upcast as a reference's would be
        t = inputs["t"].to(ctx.tested_dtype).requires_grad_(True)
        freqs = inputs["freqs"].to(torch.float32)
        out = rope_utils._apply_rotary_pos_emb_bshd(
            t,
            freqs,
            rotary_interleaved=p["interleaved"],
            multi_latent_attention=p["mla"],
            mscale=p["mscale"],
        )
        out.backward(inputs["grad_out"].to(ctx.tested_dtype))
        return {"out": out.detach().to(ctx.dtype), "grad_t": t.grad.to(ctx.dtype)}

    return dataclasses.replace(case, reference=reference)


# ---------------------------------------------------------------------------- examples

from megatron_npu.parity.cases import context_parallel as _cp_cases  # noqa: E402
from megatron_npu.parity.cases import moe as _moe_cases  # noqa: E402
from megatron_npu.parity.cases import transformer_engine as _te_cases  # noqa: E402
from megatron_npu.parity.cases.attention import _edge as _attention  # noqa: E402
from megatron_npu.parity.cases.mla_rope import _edge as _mla_rope  # noqa: E402
from megatron_npu.parity.cases.norm import _edge as _norm  # noqa: E402
from megatron_npu.parity.cases.rotary import _edge as _rotary  # noqa: E402

_SWIGLU = {"seq": 4, "batch": 2, "hidden": 64, "bias": True, "scale": 1.0, "seed": 1}
_ATTENTION = _attention()
_ATTENTION_PADDING = _attention(layout="BSH", mask="padding", seq=24, kv_seq=24, heads=2, seed=15)
_ATTENTION_WINDOW = _attention(
    seq=160, kv_seq=160, pre=16, next=0, heads=2, groups=1, head_dim=8, seed=18
)
_ATTENTION_BAND = _attention(
    seq=200, kv_seq=200, pre=80, next=0, heads=2, groups=1, head_dim=8, seed=23
)
_ATTENTION_DROPOUT = _attention(seq=32, kv_seq=32, head_dim=32, dropout=0.2, seed=20)
_ATTENTION_EVAL = _attention(dropout=0.2, training=False, seed=22)
_ATTENTION_NARROW_VALUE = _attention(head_dim=24, v_head_dim=16, seed=25)
_SOFTMAX = {"batch": 2, "heads": 2, "sq": 64, "sk": 64, "x_scale": 1.0, "seed": 1}
_RMS_TINY = _norm(scale=1e-3, eps=1e-6, seed=1)
_RMS = _norm(eps=1e-5, seed=7)
_NORM_ZERO_CENTERED = _norm(hidden=32, zero_centered=True, seed=6)
_NORM_SP = _norm(normalization="LayerNorm", hidden=24, sp=True, seed=7)
_CROSS_ENTROPY = {
    "seq": 4,
    "batch": 2,
    "vocab": 256,
    "label_smoothing": 0.0,
    "logit_scale": 1.0,
    "activation": True,
    "seed": 1,
}
_ROTARY = _rotary()
_TE_LN_LINEAR_ZERO_CENTERED = _te_cases._linear_edge(
    "layernorm-column", normalization="RMSNorm", zero_centered=True, skip_bias_add=True, seed=3
)
_TE_NORM_TINY = _te_cases._norm_edge(normalization="RMSNorm", scale=1e-3, eps=1e-6, seed=3)
_TE_ATTENTION_SCALED = _te_cases._attention_edge(
    mask="padding", softmax_scale=0.3, flash=True, seed=4
)
_ROTARY_PER_BATCH = _rotary(per_batch=True, rot_dim=16, seed=7)
_UNSCALE = {"tensors": 5, "loss_scale": 2.0**16, "plant": "none", "plant_rank": 0, "seed": 1}
_ADAMW = {
    "tensors": 5,
    "steps": 3,
    "lr": 1e-3,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "amsgrad": False,
    "grad_scale": 1.0,
    "seed": 1,
}
#: Megatron's --bf16 default: fp32 states, the master as bf16 params + int16 remainders
_PRECISION_AWARE = {k: v for k, v in _ADAMW.items() if k != "amsgrad"} | {
    "master": "fp32-remainders",
    "exp_avg_dtype": "float32",
    "exp_avg_sq_dtype": "float32",
    "grads_in_param_dtype": False,
    "resume_after": 0,
}
_GRAD_NORM = {"tensors": 5, "scale": 1.0, "seed": 1}
#: long token sums (12 x 3 tokens), fp32 main_grad: where a bf16 accumulation shows
_WGRAD = {
    "seq": 12,
    "batch": 3,
    "fan_in": 48,
    "fan_out": 48,
    "main_grad_fp32": True,
    "bias": False,
    "seed": 4,
}
#: with the 4096-element grad, where a 16-bit accumulation goes wrong
_GRAD_NORM_LARGE = {"tensors": 6, "scale": 1.0, "seed": 1}
_CLIP = {"tensors": 5, "max_norm": 0.5, "plant_inf": False, "seed": 1}
_SAMPLE_IDX = {
    "docs": 7,
    "max_doc": 40,
    "seq": 16,
    "epochs": 2,
    "drop_last": True,
    "extra": True,
    "seed": 3,
}


def _ring_lower_block_whole(original):
    def ring_steps(rank, size, local, causal):
        steps = original(rank, size, local, causal)
        # a lower rank's block read whole: its second chunk lies in the queries' future
        return [
            s._replace(kv_rows=slice(None)) if not s.causal and s.q_rows == slice(None) else s
            for s in steps
        ]

    return ring_steps


def _ring_update_weights_swapped(original):
    def npu_ring_attention_update(
        prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, **kwargs
    ):
        out, smax, ssum = original(
            prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, **kwargs
        )
        swapped, _, _ = original(cur_out, prev_max, prev_sum, prev_out, cur_max, cur_sum, **kwargs)
        return swapped, smax, ssum  # each partial output weighted by the other's share

    return npu_ring_attention_update


def _product_scalars_dropped(original):
    def upcast(value):
        # the 16-bit product's arguments: tensors upcast, every scalar (baddbmm's beta and
        # alpha) lost to 1
        return original(value) if hasattr(value, "dtype") else 1

    return upcast


def _a2a_rank_order_kept(original):
    def to_natural(x, cp):
        return x  # the gathered sequence left in rank order: causality on the wrong positions

    return to_natural


_ALL = (
    Mutation(
        "swiglu-swapped-halves",
        "SwiGLU gates with the second half: silu(b) * a",
        "megatron_npu.ops.swiglu.native_swiglu",
        _swapped_swiglu,
        "activation.bias-swiglu",
        (_SWIGLU,),
    ),
    Mutation(
        "attention-mask-inverted",
        "the fused attention reads the padding mask as True = keep",
        "megatron_npu.ops.attention.native_fused_attention",
        _inverted_mask,
        "attention.dot-product",
        (_ATTENTION_PADDING,),
    ),
    Mutation(
        "attention-scale-dropped",
        "the NPU binding does not pass the softmax scale, so the "
        "kernel uses its default 1.0 instead of 1/sqrt(d)",
        "megatron_npu.testing.torch_npu_emulation.npu_fusion_attention",
        _kernel_default_scale,
        "attention.dot-product",
        (_ATTENTION,),
        device=NPU_EMULATED,
    ),
    Mutation(
        "softmax-scale-dropped",
        "the fused softmax ignores FusedScaleMaskSoftmax.scale",
        "megatron_npu.ops.softmax.scaled_masked_softmax",
        _softmax_without_scale,
        "softmax.fused",
        ({**_SOFTMAX, "mask": "causal", "scale": 3.0},),
    ),
    Mutation(
        "softmax-mask-inverted",
        "the fused softmax masks the positions the mask keeps",
        "megatron_npu.ops.softmax.scaled_masked_softmax",
        _softmax_inverted_mask,
        "softmax.fused",
        ({**_SOFTMAX, "mask": "padding", "scale": None, "seed": 2},),
    ),
    Mutation(
        "rmsnorm-wrong-eps",
        "RMSNorm uses eps 1e-2 instead of the configured one",
        "megatron_npu.ops.norm.native_rms_norm",
        _rms_norm_eps(1e-2),
        "norm.wrapped-torch-norm",
        (_RMS_TINY,),
    ),
    Mutation(
        "rmsnorm-bf16-statistics",
        "RMSNorm computes mean(x^2) in bf16 in an fp32 model",
        "megatron_npu.ops.norm.native_rms_norm",
        _rms_norm_bf16_statistics,
        "norm.wrapped-torch-norm",
        (_RMS,),
    ),
    Mutation(
        "cross-entropy-tp-sum-dropped",
        "vocab-parallel cross entropy skips its SUM all-reduces over the tensor-parallel group",
        "megatron_npu.ops.cross_entropy._dist_reduce",
        _no_sum_all_reduce,
        "cross-entropy.vocab-parallel",
        (_CROSS_ENTROPY,),
        parallel=Parallel(tp=2),
    ),
    Mutation(
        "cross-entropy-upstream-grad-ignored",
        "the in-place cross-entropy backward drops the upstream gradient of each token's loss",
        "megatron_npu.ops.cross_entropy._softmax_to_grad",
        _upstream_grad_ignored,
        "cross-entropy.vocab-parallel",
        (_CROSS_ENTROPY,),
    ),
    Mutation(
        "mla-rope-not-regrouped",
        "multi-latent attention's fused RoPE rotates the features as they come, without "
        "regrouping the even ones before the odd ones",
        "megatron_npu.patches.rope_fusion.regrouped_rotary",
        _not_regrouped,
        "rotary.fused-mla-q",
        (_mla_rope(),),
    ),
    Mutation(
        "attention-value-padded-in-front",
        "v heads narrower than q/k are padded in front, so the columns the output keeps are "
        "partly the padding's",
        "megatron_npu.patches.attention.one_head_dim",
        _padded_in_front,
        "attention.dot-product",
        (_ATTENTION_NARROW_VALUE,),
    ),
    Mutation(
        "rotary-wrong-mode",
        "rotary rotates interleaved pairs where Megatron rotates halves",
        "megatron_npu.ops.rotary.rotate",
        _rotate_other_mode,
        "rotary.apply-bshd",
        (_ROTARY,),
    ),
    Mutation(
        "loss-scale-not-unscaled",
        "the inf check runs but the grads keep the loss scale",
        "megatron_npu.patches.optimizer.check_finite_and_unscale_",
        _not_unscaled,
        "optimizer.unscale-and-check-nan",
        (_UNSCALE,),
    ),
    Mutation(
        "adamw-bias-correction-dropped",
        "AdamW without the 1/(1 - beta**step) corrections",
        "megatron_npu.ops.adamw.native_adamw_step_",
        _adamw_no_bias_correction,
        "optimizer.adam",
        (_ADAMW,),
    ),
    Mutation(
        "adamw-update-ten-percent-high",
        "AdamW applies a learning rate 10 % too high, at a "
        "realistic lr of 1e-4 (the update is ~1e-4 of a parameter)",
        "megatron_npu.ops.adamw.native_adamw_step_",
        _adamw_lr_ten_percent_high,
        "optimizer.adam",
        ({**_ADAMW, "lr": 1e-4, "seed": 5},),
    ),
    Mutation(
        "precision-aware-remainder-dropped",
        "the precision-aware optimizer stores the bf16 param but not the master's low 16 bits, "
        "so every step restarts from the rounded param (updates below a bf16 ulp vanish), at a "
        "realistic lr of 1e-4",
        "megatron_npu.optim.precision_aware.split_master",
        _remainder_dropped,
        "optimizer.precision-aware-config",
        ({**_PRECISION_AWARE, "lr": 1e-4, "seed": 5},),
        dtype="bfloat16",
    ),
    Mutation(
        "grad-norm-missing-sqrt",
        "the l2-norm kernel returns sums of squares (TP2: Megatron all-reduces their squares)",
        "megatron_npu.patches.optimizer.multi_tensor_l2norm",
        _l2norm_without_sqrt,
        "optimizer.l2-norm",
        (_GRAD_NORM,),
        parallel=Parallel(tp=2),
    ),
    Mutation(
        "grad-norm-16bit-accumulation",
        "the l2-norm kernel sums a 16-bit tensor's squares in "
        "its own dtype (fp32 grads unaffected)",
        "megatron_npu.patches.optimizer.multi_tensor_l2norm",
        _l2norm_16bit_accumulation,
        "optimizer.l2-norm",
        (_GRAD_NORM_LARGE,),
        dtype="float16",
    ),
    Mutation(
        "grad-norm-bf16-accumulation",
        "the l2-norm kernel sums a bf16 tensor's squares in bf16",
        "megatron_npu.patches.optimizer.multi_tensor_l2norm",
        _l2norm_16bit_accumulation,
        "optimizer.l2-norm",
        (_GRAD_NORM_LARGE,),
        dtype="bfloat16",
    ),
    Mutation(
        "wgrad-accum-in-input-dtype",
        "the gradient-accumulation-fusion kernel multiplies in the "
        "activations' dtype and only upcasts the product (no fp32 accumulation)",
        "megatron_npu.ops.wgrad_accum._wgrad_fp32",
        _wgrad_in_input_dtype,
        "grad-accum-fusion.kernel",
        (_WGRAD,),
        dtype="bfloat16",
    ),
    # ---- attention: a window narrower than the sequence, dropout in training and eval
    Mutation(
        "attention-window-key-off-by-one",
        "the windowed query blocks start their key range one "
        "key late (only a window narrower than the sequence, with several blocks, runs them)",
        "megatron_npu.ops.attention.native._windowed",
        _windowed_off_by_one,
        "attention.dot-product",
        (_ATTENTION_WINDOW,),
    ),
    Mutation(
        "attention-band-kernel-window-narrowed",
        "the C++ band forward (CPU windows of 64 keys "
        "or more) leaves out the farthest key of every window",
        "megatron_npu.ops.attention.band.band_attention_forward",
        _band_kernel_window_narrowed,
        "attention.dot-product",
        (_ATTENTION_BAND,),
    ),
    Mutation(
        "attention-dropout-in-eval",
        "attention dropout applied although the module is in eval mode",
        "megatron_npu.patches.attention.fused_core_attention",
        _dropout_in_eval,
        "attention.dot-product",
        (_ATTENTION_EVAL,),
    ),
    Mutation(
        "attention-dropout-rate-halved",
        "the fused op gets half the configured attention dropout",
        "megatron_npu.patches.attention.fused_attention",
        _dropout_rate_halved,
        "attention.dot-product",
        (_ATTENTION_DROPOUT,),
    ),
    Mutation(
        "attention-kernel-dropout-not-rescaled",
        "the NPU kernel's kept probabilities are not divided by keep_prob",
        "megatron_npu.testing.torch_npu_emulation.npu_fusion_attention",
        _kernel_dropout_not_rescaled,
        "attention.dot-product",
        (_ATTENTION_DROPOUT,),
        device=NPU_EMULATED,
    ),
    # ---- norm: a bf16-only bug, zero-centred gamma, sequence parallelism
    Mutation(
        "rmsnorm-bf16-branch-eps",
        "the bf16 branch of rms_norm uses eps 1e-2 (fp32 and fp16 "
        "are right, so only the bf16 cell can see it)",
        "megatron_npu.ops.norm.rms_norm",
        _rms_norm_bf16_eps,
        "norm.wrapped-torch-norm",
        (_RMS_TINY,),
        dtype="bfloat16",
    ),
    Mutation(
        "norm-zero-centered-gamma-ignored",
        "layernorm_zero_centered_gamma read but not applied (gamma = w instead of 1 + w)",
        "megatron_npu.patches.norm.from_megatron_config",
        _norm_option_dropped("zero_centered_gamma"),
        "norm.wrapped-torch-norm",
        (_NORM_ZERO_CENTERED,),
    ),
    Mutation(
        "norm-sequence-parallel-unmarked",
        "with sequence parallelism the norm's parameters are "
        "not marked, so their grads are never all-reduced over TP",
        "megatron_npu.patches.norm.from_megatron_config",
        _norm_option_dropped("sequence_parallel"),
        "norm.wrapped-torch-norm",
        (_NORM_SP,),
    ),
    # ---- rotary: the per-batch formula path, the kernel's argument order
    Mutation(
        "rotary-per-batch-wrong-sign",
        "the per-batch-frequency path rotates (x2, -x1)",
        "megatron_npu.patches.rotary.rotate",
        _rotate_wrong_sign,
        "rotary.apply-bshd",
        (_ROTARY_PER_BATCH,),
    ),
    Mutation(
        "rotary-kernel-r1-r2-swapped",
        "the NPU binding passes sin as r1 and cos as r2",
        "megatron_npu.testing.torch_npu_emulation.npu_rotary_mul",
        _kernel_r1_r2_swapped,
        "rotary.apply-bshd",
        (_ROTARY,),
        device=NPU_EMULATED,
    ),
    # ---- softmax, activations
    Mutation(
        "softmax-causal-masks-diagonal",
        "the causal mask also hides each query's own key",
        "megatron_npu.ops.softmax._causal_mask",
        _causal_mask_with_diagonal,
        "softmax.fused",
        ({**_SOFTMAX, "mask": "causal", "scale": None},),
    ),
    Mutation(
        "swiglu-gate-bias-dropped",
        "the fused bias-SwiGLU adds the bias to the linear half only",
        "megatron_npu.patches.activation.bias_swiglu",
        _swiglu_bias_half_dropped,
        "activation.bias-swiglu",
        (_SWIGLU,),
    ),
    Mutation(
        "gelu-exact-not-tanh",
        "bias-GeLU uses the erf GELU where Megatron's fused kernel uses the tanh approximation",
        "megatron_npu.patches.activation.bias_gelu",
        _gelu_exact,
        "activation.bias-gelu",
        ({**_SWIGLU, "scale": 4.0},),
    ),
    # ---- cross entropy under TP2, optimizer, data
    Mutation(
        "cross-entropy-shard-offset-off-by-one",
        "the second TP rank's vocab shard starts one id "
        "late (only TP > 1 has a shard that does not start at 0)",
        "megatron_npu.patches.cross_entropy._op",
        _shard_offset_off_by_one,
        "cross-entropy.vocab-parallel",
        (_CROSS_ENTROPY,),
        parallel=Parallel(tp=2),
    ),
    Mutation(
        "adamw-eps-inside-sqrt",
        "AdamW adds eps inside the square root of v_hat",
        "megatron_npu.ops.adamw.native_adamw_step_",
        _adamw_eps_inside_sqrt,
        "optimizer.adam",
        ({**_ADAMW, "grad_scale": 1e-4, "eps": 1e-6, "weight_decay": 0.0},),
    ),
    Mutation(
        "unscale-nan-not-flagged",
        "the inf check zeroes NaN grads instead of flagging them",
        "megatron_npu.patches.optimizer.check_finite_and_unscale_",
        _nan_not_flagged,
        "optimizer.unscale-and-check-nan",
        ({**_UNSCALE, "plant": "nan", "loss_scale": 1024.0, "seed": 3},),
    ),
    Mutation(
        "clip-scale-squared",
        "multi_tensor_scale applies the clip coefficient squared",
        "megatron_npu.patches.optimizer.multi_tensor_scale_",
        _scale_squared,
        "optimizer.multi-tensor-scale",
        (_CLIP,),
    ),
    Mutation(
        "sample-index-offsets-late",
        "the GPT sample index puts every boundary one token late",
        "megatron_npu.data.index_helpers._build_sample_idx_impl",
        _sample_offsets_late,
        "data.build-sample-idx",
        (_SAMPLE_IDX,),
    ),
    # ---- the Transformer Engine stand-ins
    Mutation(
        "te-layernorm-linear-zero-centered-ignored",
        "TELayerNormColumnParallelLinear normalises "
        "with gamma = w where --apply-layernorm-1p stores w = gamma - 1",
        "megatron_npu.modules.te_layers.normalize",
        _te_norm_zero_centered_ignored,
        "transformer-engine.layernorm-column-parallel-linear",
        (_TE_LN_LINEAR_ZERO_CENTERED,),
    ),
    Mutation(
        "te-norm-eps-fixed",
        "TENorm's norm uses eps 1e-2 whatever TENorm(config, hidden, eps) "
        "was given (bf16: only the 16-bit stage-2 rules judge it)",
        "megatron_npu.modules.norm.normalize",
        _te_norm_eps_fixed,
        "transformer-engine.norm",
        (_TE_NORM_TINY,),
        dtype="bfloat16",
    ),
    Mutation(
        "te-attention-softmax-scale-dropped",
        "TEDotProductAttention does not hand softmax_scale "
        "on to DotProductAttention, which then scales by 1/sqrt(hn)",
        "megatron_npu.modules.te_layers._accepted",
        _te_attention_kwarg_dropped("softmax_scale"),
        "transformer-engine.dot-product-attention",
        (_TE_ATTENTION_SCALED,),
        device=NPU_EMULATED,
    ),
    # ---- a reference that calls the implementation
    Mutation(
        "reference-calls-implementation",
        "the rotary case's reference calls the patched "
        "_apply_rotary_pos_emb_bshd, so any bug in it agrees with itself",
        "megatron_npu.parity.cases.rotary.ROTARY_BSHD",
        _reference_calls_implementation,
        "rotary.apply-bshd",
        (_ROTARY,),
        scope="job",
    ),
)


def _gemm_operand_never_transposed(original):
    def _operand(t, letter):
        return t  # the layout's "T" ignored: right only for a symmetric operand

    return _operand


def _grouped_wgrad_next_group(original):
    def npu_grouped_matmul(x, weight, **kwargs):
        out = original(x, weight, **kwargs)
        if kwargs.get("group_type") == 2:  # each expert's weight gradient from its neighbour
            out = [o.roll(1, dims=0) for o in out]
        return out

    return npu_grouped_matmul


def _grouped_last_group_dropped(original):
    def grouped_mm(x, weight, group_sizes, trans_b=False):
        import torch

        out = original(x, weight, group_sizes, trans_b)
        sizes = [
            int(s) for s in (group_sizes.tolist() if torch.is_tensor(group_sizes) else group_sizes)
        ]
        keep = out.shape[0] - sizes[-1]  # the last expert's rows left at zero
        return torch.cat([out[:keep], torch.zeros_like(out[keep:])], dim=0)

    return grouped_mm


def _grouped_bias_reversed(original):
    def repeat_interleave(values, repeats, dim=None):
        return original(values.flip(0), repeats, dim=dim)  # expert g gets the bias of n-1-g

    return repeat_interleave


def _permute_slots_shifted(original):
    def npu_moe_token_permute_with_routing_map(tokens, routing_map, **kwargs):
        permuted, probs, index_map = original(tokens, routing_map, **kwargs)
        if not kwargs.get("drop_and_pad"):
            index_map = index_map.roll(1)
        return permuted, probs, index_map

    return npu_moe_token_permute_with_routing_map


def _unpermute_probs_dropped(original):
    def unpermute_with_kernel(
        kernels, permuted, index_map, restore_shape, probs, routing_map, drop_and_pad
    ):
        return original(
            kernels, permuted, index_map, restore_shape, None, routing_map, drop_and_pad
        )

    return unpermute_with_kernel


def _padding_taken_first(original):
    def npu_moe_token_permute_with_routing_map(tokens, routing_map, **kwargs):
        if kwargs.get("drop_and_pad"):  # an ascending sort: unselected tokens fill capacity
            routing_map = ~routing_map.bool()
        return original(tokens, routing_map, **kwargs)

    return npu_moe_token_permute_with_routing_map


def _gating_backward_unscaled(original):
    def npu_moe_gating_top_k_backward(x_norm, grad_y, expert_idx, **kwargs):
        return original(x_norm, grad_y, expert_idx, **{**kwargs, "routed_scaling_factor": 1.0})

    return npu_moe_gating_top_k_backward


def _gating_groups_by_max(original):
    def gating_kernel_groups(*args):
        groups = original(*args)
        return None if groups is None else (*groups[:2], 0)

    return gating_kernel_groups


_ALL = (
    *_ALL,
    # ---- mixture of experts
    Mutation(
        "router-gemm-layout-ignored",
        "the router's GEMM ignores the layout's transposes "
        "(x @ W instead of x @ W^T): shapes agree only for a square W",
        "megatron_npu.ops.gemm._operand",
        _gemm_operand_never_transposed,
        "moe.router-gating-gemm",
        (_moe_cases._router_edge(batch=None, hidden=8, experts=8, seed=5),),
    ),
    Mutation(
        "grouped-gemm-wgrad-next-expert",
        "npu_grouped_matmul's split-K weight gradient of each expert lands on the next expert",
        "megatron_npu.testing.torch_npu_emulation.npu_grouped_matmul",
        _grouped_wgrad_next_group,
        "moe.grouped-gemm-ops",
        (_moe_cases._gemm_edge(),),
        device=NPU_EMULATED,
    ),
    Mutation(
        "grouped-gemm-last-expert-dropped",
        "the grouped GEMM leaves the last expert's rows at 0",
        "megatron_npu.patches.moe.grouped_mm",
        _grouped_last_group_dropped,
        "moe.grouped-gemm-ops",
        (_moe_cases._gemm_edge(),),
    ),
    Mutation(
        "te-grouped-linear-last-expert-dropped",
        "TE's grouped linears leave the last expert's rows at 0 (the grouped GEMM of the op layer)",
        "megatron_npu.ops.grouped_matmul.grouped_mm",
        _grouped_last_group_dropped,
        "transformer-engine.column-parallel-grouped-linear",
        (_moe_cases._linear_edge(),),
    ),
    Mutation(
        "te-grouped-linear-bias-reversed",
        "TE's grouped linear adds expert g's bias to the rows of expert n-1-g",
        "torch.repeat_interleave",
        _grouped_bias_reversed,
        "transformer-engine.column-parallel-grouped-linear",
        (_moe_cases._linear_edge(),),
    ),
    Mutation(
        "permute-kernel-slots-shifted",
        "the permute kernel's slot map is one slot off, so each "
        "token is summed back from its neighbour's expert outputs",
        "megatron_npu.testing.torch_npu_emulation.npu_moe_token_permute_with_routing_map",
        _permute_slots_shifted,
        "moe.fused-permute",
        (_moe_cases._permute_edge(),),
        device=NPU_EMULATED,
    ),
    Mutation(
        "router-top-k-backward-unscaled",
        "the gating kernel's backward leaves out the routed "
        "scaling factor (the forward applies it)",
        "megatron_npu.testing.torch_npu_emulation.npu_moe_gating_top_k_backward",
        _gating_backward_unscaled,
        "moe.fused-router-top-k",
        (_moe_cases._top_k_edge(),),
        device=NPU_EMULATED,
    ),
    Mutation(
        "router-top-k-groups-by-best-expert",
        "group-limited routing scores each group by its "
        "best expert where Megatron sums its best two",
        "megatron_npu.patches.moe.gating_kernel_groups",
        _gating_groups_by_max,
        "moe.fused-router-top-k",
        (_moe_cases._top_k_edge(groups=4, group_topk=2, topk_per_group=2, seed=9, tokens=12),),
        device=NPU_EMULATED,
    ),
    Mutation(
        "moe-padding-taken-first",
        "the padded permutation fills each expert's capacity with "
        "the tokens it did not choose before those it did",
        "megatron_npu.testing.torch_npu_emulation.npu_moe_token_permute_with_routing_map",
        _padding_taken_first,
        "moe.fused-sort-chunks",
        (_moe_cases._layer_edge(capacity_factor=0.5, pad=True, grouped=True, seed=4),),
        device=NPU_EMULATED,
    ),
    Mutation(
        "unpermute-kernel-probs-dropped",
        "the fused unpermute leaves out the routing probs it "
        "was handed (every expert output weighted 1)",
        "megatron_npu.patches.moe.unpermute_with_kernel",
        _unpermute_probs_dropped,
        "moe.fused-unpermute",
        (_moe_cases._permute_edge(probs_at="unpermute", seed=7),),
        device=NPU_EMULATED,
    ),
    Mutation(
        "ring-lower-block-whole",
        "the ring lets every query see the whole block of a lower "
        "rank, whose second chunk lies in the queries' future",
        "megatron_npu.ops.ring_attention.ring_steps",
        _ring_lower_block_whole,
        "transformer-engine.context-parallel-attention",
        (_cp_cases._edge(),),
        parallel=Parallel(cp=2),
    ),
    Mutation(
        "ring-update-weights-swapped",
        "the ring-update kernel weights each partial output by the other partial's softmax share",
        "megatron_npu.testing.torch_npu_emulation.npu_ring_attention_update",
        _ring_update_weights_swapped,
        "transformer-engine.context-parallel-attention",
        (_cp_cases._edge(causal=False, seed=2),),
        device=NPU_EMULATED,
        parallel=Parallel(cp=2),
    ),
    Mutation(
        "a2a-rank-order-kept",
        "Ulysses attends over the gathered sequence in rank order, not in its natural order",
        "megatron_npu.ops.context_parallel.to_natural",
        _a2a_rank_order_kept,
        "transformer-engine.context-parallel-attention",
        (_cp_cases._edge(comm="a2a", seed=3),),
        parallel=Parallel(cp=2),
    ),
    Mutation(
        "product-scalars-dropped",
        "the fp32-accumulated 16-bit product passes its tensors on but not its scalars: "
        "baddbmm's beta 0 and alpha 1/sqrt(d) of attention's scores become 1",
        "megatron_npu.ops.half_matmul._upcast",
        _product_scalars_dropped,
        "matmul.torch-baddbmm",
        ({"n": 8, "k": 32, "m": 8, "seed": 1, "beta": 0.0, "alpha": 0.125, "out": False},),
        dtype="bfloat16",
    ),
)

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
