"""``megatron-npu info``: the device, library versions and every patch's status."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

from megatron_npu import patcher
from megatron_npu.console import tables
from megatron_npu.devices import Device, resolve, torch_npu_schema
from megatron_npu.ops import cpu_band_kernel, fallbacks
from megatron_npu.ops.adamw import fused_adamw_available
from megatron_npu.registry import Patch, all_patches
from megatron_npu.versions import library_versions

#: what a patch's NPU path runs, as ``info`` says it
NPU_KERNEL, SAME_AS_CPU = "npu kernel", "same code as cpu"


def npu_path(patch: Patch) -> dict[str, Any]:
    """Whether ``patch`` exercises a torch_npu kernel on npu / npu-emulated (and which), or
    runs there the same code as on the CPU, from the registry's ``npu_kernels``."""
    return {
        "npu_path": NPU_KERNEL if patch.exercises_npu_kernel else SAME_AS_CPU,
        "npu_kernels": list(patch.npu_kernels),
    }


#: (param, grad) dtypes Megatron hands the optimizer: fp32 main params, or 16-bit params as-is
_ADAMW_DTYPES = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
)


def fallback_rows(dev: Device) -> list[dict[str, Any]]:
    """Every algorithm fallback this process took (:mod:`megatron_npu.ops.fallbacks`), after
    probing the fused AdamW for ``dev``'s native path (the NPU path calls npu_apply_adam_w)."""
    if dev.kernels is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fallbacks.FusedKernelFallbackWarning)  # shown below
            for dtype, grad_dtype in _ADAMW_DTYPES:
                fused_adamw_available(dev.torch_device(), dtype, grad_dtype)
    return [f.as_dict() for f in fallbacks.recorded()]


def kernel_facts(dev: Device) -> dict[str, Any]:
    """Per torch_npu kernel the adaptor uses (the registry's ``npu_kernels``): whether the pinned
    torch_npu release has it (its schema file), whether the device's kernel module has it (None
    on a device without one: the native path runs there), and which patches call it; plus the
    release the calls are checked against and what the device's kernel module is."""
    header = torch_npu_schema.schema_file().header
    callers: dict[str, list[str]] = {}
    for patch in all_patches():
        for kernel in patch.npu_kernels:
            callers.setdefault(kernel, []).append(patch.id)
    missing = set(dev.missing_kernels(callers))
    return {
        "schemas_of": f"torch_npu {header['torch_npu']}",
        "build_branch": header["build_branch"],
        "device_kernels": dev.kernels_source,
        "kernels": [
            {
                "name": name,
                "in_pinned_torch_npu": torch_npu_schema.has_kernel(name),
                "on_device": None if dev.kernels is None else name not in missing,
                "patches": callers[name],
            }
            for name in sorted(callers)
        ],
        "missing": sorted(missing),
    }


def collect(device: str | None = None) -> dict[str, Any]:
    """Apply the registry for ``device`` without stopping at failures, and describe the result.

    The process is left as it was found: the patches are applied only while the statuses are
    read (:func:`megatron_npu.patcher.applied_for`)."""
    dev: Device = resolve(device)
    with patcher.applied_for(dev, strict=False) as results:
        pass
    by_id = {p.id: p for p in all_patches()}
    return {
        "device": {
            "name": dev.name,
            "torch_device": dev.torch_type,
            "dist_backend": dev.dist_backend,
            "emulated": dev.emulated,
            "description": dev.describe(),
        },
        "versions": library_versions(),
        # windowed attention's forward on cpu (the native path runs only there)
        "cpu_band_attention": cpu_band_kernel.status().describe() if dev.name == "cpu" else None,
        # kernels missing here, and what runs instead (a named warning when first taken)
        "fallbacks": fallback_rows(dev),
        "torch_npu_kernels": kernel_facts(dev),
        "patches": [
            {
                **r.as_dict(),
                "kind": by_id[r.id].kind,
                "versions": by_id[r.id].versions or "any",
                "devices": sorted(by_id[r.id].devices),
                **npu_path(by_id[r.id]),
            }
            for r in results
        ],
    }


def render(data: dict[str, Any], file: Any = None) -> None:
    from rich.table import Table

    console = tables(file)
    console.print(f"[bold]device[/bold]   {data['device']['description']}")
    for name, version in data["versions"].items():
        console.print(f"[bold]{name:<14}[/bold] {version or 'not installed'}")
    if data["cpu_band_attention"]:
        console.print(f"[bold]windowed attention forward[/bold] {data['cpu_band_attention']}")
    kernels = data.get("torch_npu_kernels")
    if kernels:
        here = kernels["device_kernels"] or "none on this device (native torch paths)"
        console.print(
            f"[bold]torch_npu kernels[/bold] calls checked against {kernels['schemas_of']} "
            f"({kernels['build_branch']}); this device's kernels: {here}"
        )
        for row in kernels["kernels"]:
            pinned = "in" if row["in_pinned_torch_npu"] else "[bold red]NOT in[/]"
            device = {None: "", True: "; on this device", False: "; [bold red]missing here[/]"}[
                row["on_device"]
            ]
            console.print(f"  {row['name']}: {pinned} {kernels['schemas_of']}{device}")
    for row in data.get("fallbacks", ()):
        console.print(f"[bold yellow]fallback[/bold yellow] {row['description']}")
    table = Table(title="patches", show_lines=False)
    for column in ("id", "target", "status", "npu path", "reason"):
        table.add_column(column, overflow="fold")
    styles = {"applied": "green", "failed": "bold red", "kept-original": "yellow"}
    for row in data["patches"]:
        style = styles.get(row["status"], "dim")
        npu = row["npu_path"]
        if row["npu_kernels"]:
            npu = f"[cyan]{npu}[/]: {', '.join(row['npu_kernels'])}"
        table.add_row(row["id"], row["target"], f"[{style}]{row['status']}[/]", npu, row["reason"])
    console.print(table)
    counts: dict[str, int] = {}
    for row in data["patches"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    console.print(", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    kernel = sum(row["npu_path"] == NPU_KERNEL for row in data["patches"])
    console.print(
        f"on npu / npu-emulated: {kernel} patches exercise an NPU kernel, "
        f"{len(data['patches']) - kernel} run the same code as cpu"
    )


def main(device: str | None, as_json: bool) -> int:
    data = collect(device)
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(data)
    return 1 if any(p["status"] == patcher.FAILED for p in data["patches"]) else 0
