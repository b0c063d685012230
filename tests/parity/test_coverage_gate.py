"""Every registry patch has a parity case, or an explicit exemption with a reason."""

from __future__ import annotations

from megatron_npu.registry import all_patches
from parity.case import ParityCase, load_case
from parity.matrix import cells


def test_every_patch_has_a_parity_case_or_a_reasoned_exemption():
    missing = [p.id for p in all_patches() if not p.parity and not p.parity_exempt.strip()]
    assert not missing, f"patches without a parity case or exemption: {missing}"


def test_parity_references_resolve_to_cases():
    for patch in all_patches():
        if patch.parity:
            assert isinstance(load_case(patch.parity), ParityCase), patch.id


def test_no_patch_is_both_covered_and_exempt():
    both = [p.id for p in all_patches() if p.parity and p.parity_exempt]
    assert not both, both


def test_matrix_covers_every_case_on_both_ci_devices():
    covered = {(c.patch.id, c.device) for c in cells()}
    for patch in all_patches():
        if patch.parity:
            for device in ("cpu", "npu-emulated"):
                assert (patch.id, device) in covered, (patch.id, device)
