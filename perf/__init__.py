"""Benchmarks of megatron-npu: one generated benchmark per registry patch, plus targets.

Run with ``pytest perf --benchmark-only`` (this package is not in the default test paths); see
``perf/README.md`` for the regression gate and what each figure means.
"""
