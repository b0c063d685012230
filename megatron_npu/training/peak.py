"""The peak FLOP/s that MFU is measured against: a GEMM probe cached per machine, or
the user's figure.

``measured_peak_flops(device, dtype)`` times square matrix multiplications on the device's torch
backend (the largest of a few sizes, best of several repetitions, after a warm-up) and keeps the
best rate. The figure is cached in ``~/.cache/megatron-npu/peak.json`` (``$XDG_CACHE_HOME`` is
honoured) under a key naming the host, device, dtype, torch version and core count, so the
probe runs once per machine and configuration. On the CPU the probe uses every core of the host
(whatever thread count the calling rank was given). ``$MEGATRON_NPU_PEAK_TFLOPS`` (or ``train
--peak-tflops``) states the peak instead and skips the probe.

A probe taken while the machine is busy reads low (and MFU high): delete the cache file, or state
the peak, to measure again. The peak is *per device*. On ``cpu`` and ``npu-emulated`` every rank
shares one host, so the aggregate peak of a run is one host's; on ``npu`` and ``cuda`` it is the
per-device peak times the world size (:func:`aggregate_devices`). A measured GEMM peak is what the
hardware sustains on dense matmuls, below the datasheet figure; MFU against it reads higher than
against a datasheet peak.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_npu.devices.facts import facts
from megatron_npu.files import write_private

ENV_VAR = "MEGATRON_NPU_PEAK_TFLOPS"
PROBE_REPEATS = 3
#: A size whose warm-up GEMM takes longer than this is the last one tried (slow dtypes on CPU).
PROBE_SIZE_BUDGET_S = 0.2


@dataclass(frozen=True)
class PeakFlops:
    """A per-device peak: ``tflops`` (1e12 FLOP/s), where it came from and what it measured."""

    tflops: float
    source: str  # "measured" | "cached" | "user"
    device: str
    dtype: str
    detail: str

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-npu" / "peak.json"


def host_cores() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def _cache_key(device: str, dtype: torch.dtype) -> str:
    return (
        f"{platform.node()}|{device}|{_dtype_name(dtype)}|torch {torch.__version__}"
        f"|cores {host_cores()}"
    )


def user_peak(tflops: float, device: str, dtype: torch.dtype, origin: str) -> PeakFlops:
    if not tflops > 0:
        raise ValueError(f"{origin}: the peak must be a positive number of TFLOP/s, got {tflops!r}")
    return PeakFlops(float(tflops), "user", device, _dtype_name(dtype), f"stated by {origin}")


def _env_peak(device: str, dtype: torch.dtype) -> PeakFlops | None:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${ENV_VAR}={raw!r} is not a number of TFLOP/s") from None
    return user_peak(value, device, dtype, f"${ENV_VAR}")


def probe_gemm_tflops(
    torch_type: str, sizes: tuple[int, ...], dtype: torch.dtype, sync=lambda: None
) -> tuple[float, str]:
    """Best sustained TFLOP/s of square matmuls of ``sizes`` on ``torch_type`` in ``dtype``, and
    what ran."""
    best, best_n = 0.0, sizes[0]
    # the operands come from a generator of the probe's own: a draw from torch's default one
    # would move the state training draws its weights and dropout masks from, so a run that
    # measures the peak (no cached figure) would train another model than one that reads it
    operands = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=operands).to(device=torch_type, dtype=dtype)
        b = torch.randn(n, n, generator=operands).to(device=torch_type, dtype=dtype)
        start = time.perf_counter()
        torch.matmul(a, b)  # warm-up: allocation, kernel selection
        sync()
        last_size = time.perf_counter() - start > PROBE_SIZE_BUDGET_S
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            torch.matmul(a, b)
            sync()
            elapsed = time.perf_counter() - start
            rate = 2.0 * n**3 / elapsed / 1e12 if elapsed > 0 else 0.0
            if rate > best:
                best, best_n = rate, n
        if last_size:
            break
    detail = f"GEMM probe {best_n}x{best_n} {_dtype_name(dtype)}, best of {PROBE_REPEATS} per size"
    return best, detail


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, entries: dict[str, dict]) -> None:
    try:
        write_private(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
    except OSError:
        pass  # a read-only home only costs a re-probe next time


def measured_peak_flops(device: str, dtype: torch.dtype, *, refresh: bool = False) -> PeakFlops:
    """The per-device peak for ``device`` in ``dtype``: ``$MEGATRON_NPU_PEAK_TFLOPS`` if set, else
    the cached probe for this machine, else a fresh GEMM probe (then cached)."""
    stated = _env_peak(device, dtype)
    if stated is not None:
        return stated
    path, key = cache_path(), _cache_key(device, dtype)
    entries = _read_cache(path)
    hit = entries.get(key)
    if hit and not refresh and isinstance(hit.get("tflops"), (int, float)) and hit["tflops"] > 0:
        return PeakFlops(
            float(hit["tflops"]), "cached", device, _dtype_name(dtype), str(hit.get("detail", ""))
        )
    from megatron_npu import devices

    dev = devices.make(device)
    sync = getattr(dev.accelerator, "synchronize", None) if dev.torch_type != "cpu" else None
    threads = torch.get_num_threads()
    if dev.torch_type == "cpu":  # the host's peak: every core, whatever this rank was given
        torch.set_num_threads(host_cores())
    try:
        tflops, detail = probe_gemm_tflops(
            dev.torch_type, dev.facts.probe_sizes, dtype, sync or (lambda: None)
        )
    finally:
        torch.set_num_threads(threads)
    entries[key] = {
        "tflops": tflops,
        "detail": detail,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_cache(path, entries)
    return PeakFlops(tflops, "measured", device, _dtype_name(dtype), detail)


def resolve_peak(device: str, dtype: torch.dtype, stated_tflops: float | None = None) -> PeakFlops:
    """``--peak-tflops`` when given, else :func:`measured_peak_flops`."""
    if stated_tflops is not None:
        return user_peak(stated_tflops, device, dtype, "--peak-tflops")
    return measured_peak_flops(device, dtype)


def aggregate_devices(device: str, world_size: int) -> int:
    """How many peaks a run of ``world_size`` ranks on ``device`` can draw on
    (1 for a shared host)."""
    return 1 if facts(device).host_shared else max(1, world_size)


def plausible(utilisation: float | None) -> float | None:
    """``utilisation`` unless it exceeds 1: then the peak was understated (a probe taken on a busy
    machine, or a wrong stated figure) and there is no meaningful MFU."""
    return utilisation if utilisation is not None and utilisation <= 1.0 else None


def mfu(flops_per_s: float, peak: PeakFlops, *, devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``devices`` x the per-device peak."""
    if peak.tflops <= 0:
        raise ValueError(f"peak must be positive, got {peak.tflops} TFLOP/s")
    return flops_per_s / (peak.flops_per_s * devices)
