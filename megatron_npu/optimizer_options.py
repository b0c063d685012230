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
