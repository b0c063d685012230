"""``megatron-npu info --json`` lists every registry patch with its status on cpu."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from megatron_npu.patcher import STATUSES
from megatron_npu.registry import all_patches


def _info_json(device: str) -> dict:
    env = {**os.environ, "MEGATRON_NPU_DEVICE": device}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "info", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_info_json_lists_every_patch_on_cpu():
    data = _info_json("cpu")
    assert set(data) >= {"device", "versions", "patches"}
    assert data["device"]["name"] == "cpu" and data["device"]["emulated"] is False
    assert data["versions"]["megatron-core"] and data["versions"]["torch"]
    rows = data["patches"]
    assert [r["id"] for r in rows] == [p.id for p in all_patches()]
    for row in rows:
        assert {"id", "target", "status", "reason"} <= set(row)
        assert row["status"] in STATUSES
        assert row["status"] != "failed", row
        assert row["reason"]
    assert sum(r["status"] == "applied" for r in rows) > 0
    # which forward windowed attention takes on cpu; the tests build the C++ one
    assert data["cpu_band_attention"] == "C++ band kernel"


def test_registry_entries_are_well_formed():
    patches = all_patches()
    assert len({p.id for p in patches}) == len(patches)
    for p in patches:
        assert p.reason.strip(), p.id
        assert p.parity is not None or p.parity_exempt.strip(), f"{p.id}: no parity case"


def test_info_separates_npu_kernels_from_cpu_code():
    """Per patch: an NPU kernel binding (named) or the same code as cpu, from the registry."""
    from megatron_npu.info import NPU_KERNEL, SAME_AS_CPU, collect, render

    data = collect("cpu")
    by_id = {p.id: p for p in all_patches()}
    for row in data["patches"]:
        patch = by_id[row["id"]]
        assert row["npu_kernels"] == list(patch.npu_kernels)
        assert row["npu_path"] == (NPU_KERNEL if patch.npu_kernels else SAME_AS_CPU)
    kernels = {r["id"]: r["npu_kernels"] for r in data["patches"] if r["npu_path"] == NPU_KERNEL}
    assert kernels["activation.bias-swiglu"] == ["npu_swiglu"]
    assert kernels["attention.dot-product"] == ["npu_fusion_attention"]
    assert "cross-entropy.vocab-parallel" not in kernels  # an fp32 torch op on every device
    out = io.StringIO()
    render(data, file=out)
    assert f"{len(kernels)} patches exercise an NPU kernel" in out.getvalue()


def test_info_says_per_kernel_whether_the_pinned_torch_npu_has_it():
    from megatron_npu.devices import torch_npu_schema
    from megatron_npu.info import collect, render

    pinned = torch_npu_schema.pinned_version()
    used = sorted({k for p in all_patches() for k in p.npu_kernels})
    for device, on_device, source in (
        ("cpu", None, None),
        ("npu-emulated", True, f"the emulation of torch_npu {pinned}"),
    ):
        data = collect(device)
        facts = data["torch_npu_kernels"]
        assert facts["schemas_of"] == f"torch_npu {pinned}"
        assert facts["build_branch"] == torch_npu_schema.schema_file().header["build_branch"]
        assert facts["device_kernels"] == source and facts["missing"] == []
        assert [row["name"] for row in facts["kernels"]] == used
        for row in facts["kernels"]:
            assert row["in_pinned_torch_npu"] is True and row["on_device"] is on_device
            assert row["patches"] == [p.id for p in all_patches() if row["name"] in p.npu_kernels]
        out = io.StringIO()
        render(data, file=out)
        text = out.getvalue()
        assert f"calls checked against torch_npu {pinned}" in text
        assert all(f"{k}: in torch_npu {pinned}" in text for k in used)
