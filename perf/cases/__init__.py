"""Benchmark cases, one module per area like :mod:`megatron_npu.patches`."""
