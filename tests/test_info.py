"""``megatron-npu info --json`` lists every registry patch with its status on cpu."""

from __future__ import annotations

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
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
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


def test_registry_entries_are_well_formed():
    patches = all_patches()
    assert len({p.id for p in patches}) == len(patches)
    for p in patches:
        assert p.reason.strip(), p.id
        assert p.parity is not None or p.parity_exempt.strip(), f"{p.id}: no parity case"
