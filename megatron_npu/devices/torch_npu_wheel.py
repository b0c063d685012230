"""Fetch the pinned torch_npu wheel and read its kernel schemas (never installs it).

The wheel installs only on a machine with Ascend's CANN, but any machine can download it: it is
a zip holding ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``, the schema of every
kernel. ``python -m megatron_npu.devices.torch_npu_wheel`` downloads the release the schema file
names (or the one ``--version`` gives) into a cache outside the checkout and rewrites
``torch_npu_schemas.txt`` from it; the test suite uses the same functions to hold the committed
file equal to the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from megatron_npu import console
from megatron_npu.devices import torch_npu_schema

SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
#: the shared library whose registered operator schemas carry the binding's argument names
LIBRARY = "torch_npu/lib/libtorch_npu.so"
#: any one platform's wheel: the schemas are the same on every platform
PLATFORM = "manylinux_2_28_x86_64"
PYTHON = "3.11"
CACHE_ENV = "MEGATRON_NPU_CACHE"


class WheelUnavailableError(RuntimeError):
    """The wheel could not be downloaded (no package index reachable, or no such release)."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "megatron-npu")
    return Path(root) / "wheels"


def download(version: str, dest: Path | None = None) -> Path:
    """The torch_npu ``version`` wheel, downloaded into ``dest`` (the cache) once."""
    dest = dest or cache_dir()
    pattern = f"torch_npu-{version}-*.whl"
    found = sorted(dest.glob(pattern)) if dest.is_dir() else []
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    # into a private folder first, so a concurrent reader never sees a partial wheel
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as staging:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            PLATFORM,
            "--python-version",
            PYTHON,
            "--dest",
            staging,
            f"torch_npu=={version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        got = sorted(Path(staging).glob(pattern))
        if proc.returncode != 0 or not got:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise WheelUnavailableError(f"pip could not download torch_npu=={version}: {last}")
        os.replace(got[0], dest / got[0].name)
    return dest / got[0].name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def yaml_schemas(wheel: Path) -> list[str]:
    """Every ``npu_*`` kernel schema in the wheel's codegen yaml, deduplicated and sorted."""
    import yaml

    with zipfile.ZipFile(wheel) as archive:
        data = yaml.load(
            archive.read(SCHEMA_YAML), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        )
    found = set()
    for section in data.values():
        for entry in section if isinstance(section, list) else ():
            func = entry.get("func", "") if isinstance(entry, dict) else ""
            if func.startswith("npu_"):
                found.add(" ".join(func.split()))
    return sorted(found)


def registered_schemas(wheel: Path) -> dict[str, str]:
    """The operator schemas torch_npu registers with the dispatcher, by kernel name, as the
    strings compiled into its library (their argument names are the Python binding's)."""
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(LIBRARY)
    pattern = re.compile(rb"\x00(npu_[a-z0-9_]+)\([^\x00]*\) -> [^\x00]+\x00")
    return {m.group(1).decode(): m.group(0)[1:-1].decode() for m in pattern.finditer(data)}


def build_branch(wheel: Path) -> str:
    """The source branch the wheel's README builds from (``vX.Y.Z-<TorchNPU release>``)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode("utf-8", "replace")
    match = re.search(r"git clone \S+ -b (v[\w.\-]+)", text)
    return match.group(1) if match else "unknown"


def render(wheel: Path, version: str) -> str:
    """The text of :data:`torch_npu_schema.SCHEMA_FILE` for ``wheel``."""
    header = {
        "torch_npu": version,
        "wheel": wheel.name,
        "sha256": _sha256(wheel),
        "source": SCHEMA_YAML,
        "build_branch": build_branch(wheel),
    }
    lines = [
        "# torch_npu's kernel schemas, one `func:` line per npu_* kernel and overload, verbatim",
        "# from the wheel below. Written by `python -m megatron_npu.devices.torch_npu_wheel`;",
        "# tests/devices/test_torch_npu_schema.py holds it equal to the wheel.",
        *(f"# {key}: {header[key]}" for key in torch_npu_schema.HEADER_KEYS),
        *yaml_schemas(wheel),
    ]
    return "\n".join(lines) + "\n"


def schema_path() -> Path:
    return Path(torch_npu_schema.__file__).with_name(torch_npu_schema.SCHEMA_FILE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_npu.devices.torch_npu_wheel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--version", help="torch_npu release (default: the schema file's)")
    parser.add_argument("--wheel", type=Path, help="a downloaded wheel to read instead")
    args = parser.parse_args(argv)
    version = args.version or torch_npu_schema.pinned_version()
    try:
        wheel = args.wheel or download(version)
    except WheelUnavailableError as exc:
        console.error(f"error: {exc}")
        return 2
    schema_path().write_text(render(wheel, version), encoding="utf-8")
    console.say(f"wrote {schema_path()} from {wheel.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
