"""Datasheet peaks of the GPUs a Megatron-LM log comes from, for the MFU of imported runs.

A log says nothing of its GPU; the matrix's ``hardware`` label does (``"8x H100 SXM"``). The
peak is per device, for the run's precision, dense (no structured sparsity), from NVIDIA's
datasheets:

=============  =========================  ==================================
GPU            bf16 / fp16 (TFLOP/s)      fp32 without TF32 (TFLOP/s)
=============  =========================  ==================================
H100 SXM       989                        67
H100 PCIe      756                        51
H200           989                        67
A100           312                        19.5
=============  =========================  ==================================

"H100" alone is the SXM part. A label that names none of them gets no datasheet peak (the MFU
column stays empty, as for any run without a peak).
"""

from __future__ import annotations

import re

#: (pattern on the label, name, {precision: dense TFLOP/s per device}); the first match wins
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    (r"\bH100\b", "H100 SXM", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    (r"\bH200\b", "H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    (r"\bA100\b", "A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
)


def peak(label: str | None, precision: str) -> tuple[float, str] | None:
    """``(TFLOP/s per device, what it is)`` for the GPU ``label`` names at ``precision``
    (``fp32``, ``bf16``, ``fp16``), or None."""
    if not label:
        return None
    for pattern, name, figures in PEAKS:
        if re.search(pattern, label, re.IGNORECASE) and precision in figures:
            return figures[precision], f"{name} datasheet, dense {precision}"
    return None
