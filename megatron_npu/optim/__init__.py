"""Optimizers the registry installs in place of Megatron's CUDA-only ones."""
