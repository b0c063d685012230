"""HTML accuracy and performance reports: one self-contained page from parity records,
``compare`` results, pytest-benchmark JSON and ``info --json`` output.

``build_report(inputs, output, *, diff_base=None) -> Path`` is the API; ``megatron-npu report``
the command (:mod:`megatron_npu.reports.cli`).
"""

from megatron_npu.reports.build import build_report
from megatron_npu.reports.errors import ReportInputError, Skipped

__all__ = ["ReportInputError", "Skipped", "build_report"]
