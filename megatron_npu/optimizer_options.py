"""Optimizer options that cannot work together, for both trainers: ``megatron-npu train``
(:mod:`megatron_npu.training.arguments`) and Megatron-LM's own scripts
(:mod:`megatron_npu.patches.megatron_lm`) refuse them with the same line."""

from __future__ import annotations


def sharded_optimizer_problems(optimizer: str, sharded: bool, offloaded: bool) -> list[str]:
    """``--optimizer sgd`` with the distributed optimizer (``sharded``: it, or Megatron-FSDP,
    which shards through it): megatron-core's ``DistributedOptimizer`` asserts Adam, for its
    checkpoint layout, on every rank of every device; the host-offloaded hybrid optimizer
    (``offloaded``) is the one exception."""
    if optimizer == "sgd" and sharded and not offloaded:
        return [
            "--optimizer sgd: Megatron's distributed optimizer takes Adam only, for its "
            "checkpoint layout (Megatron's own assertion, on any device): use --optimizer adam, "
            "or SGD without sharding the optimizer"
        ]
    return []


def offload_problems(offloaded: bool, half_precision: bool) -> list[str]:
    """``--optimizer-cpu-offload`` with an fp32 model: megatron-core's distributed optimizer
    hands the ``HybridDeviceOptimizer`` it builds the fp32 parameters' shards as views of the
    parameters, which torch's optimizer constructor refuses ("can't optimize a non-leaf
    Tensor"), on every device and release. The offload's recipe is a bf16 (or fp16) model."""
    if offloaded and not half_precision:
        return [
            "--optimizer-cpu-offload without --bf16 or --fp16: megatron-core's hybrid optimizer "
            "is built on the fp32 model's parameter shards, which torch's optimizers refuse as "
            "non-leaf views (Megatron's own code, on any device): add --bf16"
        ]
    return []


def precision_aware_fp16_problems(
    precision_aware: bool, fp16: bool, grads_in_fp32: bool, clip_grad: float
) -> list[str]:
    """``--use-precision-aware-optimizer`` with ``--fp16``: megatron-core's distributed optimizer
    hands the precision-aware optimizer each main gradient as ``decoupled_grad``, which is fp16
    unless ``--accumulate-allreduce-grads-in-fp32`` (Megatron-LM turns that on by itself for bf16
    only), and its gradient clipping asserts an fp32 or bf16 ``decoupled_grad`` at the first
    applied update, on every device and release. Without clipping (``--clip-grad 0``) that
    assertion is not reached."""
    if precision_aware and fp16 and not grads_in_fp32 and clip_grad > 0:
        return [
            "--use-precision-aware-optimizer with --fp16: megatron-core's gradient clipping "
            "takes fp32 or bf16 gradients only, and fp16 keeps them in fp16 (Megatron's own "
            "assertion at the first applied update, on any device): add "
            "--accumulate-allreduce-grads-in-fp32"
        ]
    return []
