"""Versions of everything that shapes a result, for ``info``, metrics and report provenance."""

from __future__ import annotations

import importlib.metadata
import platform

import torch


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """``torch``, ``torch_npu`` (None if not installed), ``megatron-core``, ``python``, ours."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_npu": _dist_version("torch_npu"),
        "megatron-core": _dist_version("megatron-core"),
        "megatron-npu": _dist_version("megatron-npu"),
    }
