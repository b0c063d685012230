"""Parity harness: every function the adaptor patches, checked against a CPU reference.

Public API of the metrics / verdict / results layer:

* :func:`compare` -> :class:`TensorComparison` (msprobe accuracy metrics of one tensor)
* :func:`verdict` / :func:`worst` -> :class:`Verdict`, with an optional :class:`Tolerance`
* :func:`build_record` / :func:`failed_record` -> :class:`ParityRecord`, :func:`write_record`,
  :func:`read_records`, :func:`summary_table`, :func:`print_summary` (structured JSON results;
  the record is :mod:`megatron_npu.formats.parity_record`, described in
  ``docs/parity-results.md``)
"""

from megatron_npu.parity.metrics import TensorComparison, compare
from megatron_npu.parity.provenance import Git, Provenance, collect_provenance, detect_device
from megatron_npu.parity.results import (
    DEVICES,
    SCHEMA_VERSION,
    ParityRecord,
    build_record,
    failed_record,
    read_records,
    record_filename,
    write_record,
)
from megatron_npu.parity.summary import SummaryRow, print_summary, summary_table
from megatron_npu.parity.verdict import Tolerance, Verdict, verdict, worst

__all__ = [
    "DEVICES",
    "SCHEMA_VERSION",
    "Git",
    "ParityRecord",
    "Provenance",
    "SummaryRow",
    "TensorComparison",
    "Tolerance",
    "Verdict",
    "collect_provenance",
    "build_record",
    "compare",
    "detect_device",
    "failed_record",
    "print_summary",
    "read_records",
    "record_filename",
    "summary_table",
    "verdict",
    "worst",
    "write_record",
]
