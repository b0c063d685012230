"""Where a parity record (or a compare result) was made: the software and hardware versions, the
git commit of the checkout, the host, and the device label of the process -- ``npu`` only for a
real Ascend NPU through torch_npu, ``npu-emulated`` whenever the torch_npu emulation serves the
kernels."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


from megatron_npu.devices.facts import CPU, CUDA, DEVICE_ORDER, NPU, NPU_EMULATED
from megatron_npu.formats.parity_record import Git, Provenance

#: the device labels a record may carry, in the order results list them
DEVICES = DEVICE_ORDER


def _is_emulation(module: Any) -> bool:
    """Whether ``module`` is the torch_npu emulation (it says so: ``IS_EMULATION``)."""
    return module is not None and getattr(module, "IS_EMULATION", False) is True


def _package_version(dist: str, module: str | None = None) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    mod = sys.modules.get(module or dist)
    if _is_emulation(mod):  # the emulation stands in as sys.modules["torch_npu"]
        return None
    version = getattr(mod, "__version__", None)
    return str(version) if version is not None else None


def source_checkout() -> Path | None:
    """The source checkout this package runs from, or None for an installed package.

    A checkout is the folder above the ``megatron_npu`` package whose ``pyproject.toml`` names
    the ``megatron-npu`` project; an installed wheel in site-packages has no such file, so
    provenance never runs git in whatever folder happens to enclose the installation.
    """
    import megatron_npu

    folder = Path(megatron_npu.__file__).resolve().parent.parent
    pyproject = folder / "pyproject.toml"
    try:
        with pyproject.open("rb") as stream:
            name = tomllib.load(stream).get("project", {}).get("name")
    except (OSError, ValueError):
        return None
    return folder if name == "megatron-npu" else None


def git_info(repo_dir: str | os.PathLike[str] | None = None) -> Git | None:
    """HEAD's short sha and a dirty flag for the tree at ``repo_dir``; None if git can't tell.

    ``repo_dir`` defaults to this package's own :func:`source_checkout`; an installed package
    has none and gets None without running git. Never raises. Uses ``--no-optional-locks`` so
    it never takes the index lock from someone committing in the same tree.
    """
    if repo_dir is None:
        repo_dir = source_checkout()
        if repo_dir is None:
            return None
    cwd = Path(repo_dir)

    def run(*args: str) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(
                ["git", "--no-optional-locks", *args],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None

    status = run("status", "--porcelain")
    if status is None or status.returncode != 0:
        return None
    head = run("rev-parse", "--short", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else None
    return Git(commit=commit or None, dirty=bool(status.stdout.strip()))


def _active_adaptor_device() -> Any:
    try:
        from megatron_npu.devices import active
    except ImportError:
        return None
    try:
        return active()
    except Exception:  # noqa: BLE001 - provenance must never fail on the device layer
        return None


def _emulation_active() -> bool:
    device = _active_adaptor_device()
    if device is not None and getattr(device, "emulated", False):
        return True
    try:
        from megatron_npu.ops.kernels import npu_kernels
    except ImportError:
        kernels = None
    else:
        kernels = npu_kernels()
    return _is_emulation(kernels) or _is_emulation(sys.modules.get("torch_npu"))


def detect_device() -> str:
    """The device label of this process: the active adaptor device's name if one is applied,
    else npu-emulated (emulation kernels active), npu (torch_npu sees a device), cuda, cpu."""
    device = _active_adaptor_device()
    name = getattr(device, "name", None)
    if name in DEVICES:
        return NPU_EMULATED if getattr(device, "emulated", False) else name
    if _emulation_active():
        return NPU_EMULATED
    import torch

    if "torch_npu" in sys.modules:
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            return NPU
    if torch.cuda.is_available():
        return CUDA
    return CPU


def collect_provenance(
    device: str,
    *,
    seed: int | None,
    wall_time_s: float,
    device_name: str | None = None,
    repo_dir: str | os.PathLike[str] | None = None,
) -> Provenance:
    """Provenance of this process for a case run on ``device``.

    Raises ValueError for an unknown label, for "npu" while the torch_npu emulation is the active
    kernel module, and for "npu" without torch_npu installed.
    """
    import torch

    check_device(device)
    torch_npu = _package_version("torch_npu")
    if device == NPU:
        if _emulation_active():
            raise ValueError(f"the torch_npu emulation is active: label this run {NPU_EMULATED!r}")
        if torch_npu is None:
            raise ValueError(f"device {NPU!r} needs torch_npu; an emulated run is {NPU_EMULATED!r}")
    return Provenance(
        device=device,
        python=platform.python_version(),
        torch=str(torch.__version__),
        torch_npu=torch_npu,
        megatron_core=_package_version("megatron-core", "megatron.core"),
        megatron_npu=_package_version("megatron-npu", "megatron_npu"),
        hypothesis=_package_version("hypothesis"),
        git=git_info(repo_dir),
        seed=seed,
        hostname=socket.gethostname(),
        timestamp_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        wall_time_s=float(wall_time_s),
        device_name=device_name,
    )


def check_device(device: Any) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
