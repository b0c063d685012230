"""Every registry patch has a parity case, or an explicit exemption with a reason and a test
that exists and fails when the patch is disabled (run here with ``MEGATRON_NPU_DISABLE``)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_npu.parity.case import ParityCase, load_case
from megatron_npu.parity.matrix import cells

from megatron_npu.patcher import megatron_core_version
from megatron_npu.registry import all_patches

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


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
    """Every parity case of a patch for the installed megatron-core has cells on both CI
    devices (a patch for another release has none here: its target may not exist; tox runs it
    on its own release)."""
    covered = {(c.patch.id, c.device) for c in cells()}
    installed = megatron_core_version()
    for patch in all_patches():
        if patch.parity and patch.applies_to_version(installed):
            for device in ("cpu", "npu-emulated"):
                assert (patch.id, device) in covered, (patch.id, device)


# ------------------------------------------------------------------------- exemptions


def _node(test: str) -> tuple[Path, str, str]:
    """``path::function[param]`` -> (file, function, param or '')."""
    path, _, rest = test.partition("::")
    function, _, param = rest.partition("[")
    return REPO / path, function, param.removesuffix("]")


def _exempt() -> list:
    return [p for p in all_patches() if p.parity_exempt]


def test_every_exemption_names_a_test_that_exists():
    for patch in _exempt():
        path, function, param = _node(patch.exempt_test)
        assert path.is_file(), f"{patch.id}: {patch.exempt_test}: no file {path}"
        tree = ast.parse(path.read_text())
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defs, f"{patch.id}: {patch.exempt_test}: no test {function}"
        if param:  # a parametrised node: the function must be parametrised
            marks = [ast.unparse(d) for d in defs[function].decorator_list]
            assert any("parametrize" in m for m in marks), f"{patch.id}: {function} takes no params"


def _groups() -> dict[tuple[Path, str], tuple[list[str], list[str]]]:
    """Exempt patches grouped by test function: (patch ids, node ids). A function parametrised
    by patch id (the device-namespace entries) runs once with all its ids disabled, each case
    checking only its own patch."""
    groups: dict[tuple[Path, str], tuple[list[str], list[str]]] = {}
    installed = megatron_core_version()
    # a patch for other megatron-core versions is not installed here, so disabling it cannot make
    # its test fail: tox's per-version runs cover it (its test must still exist, checked above)
    for patch in (p for p in _exempt() if p.applies_to_version(installed)):
        path, function, _ = _node(patch.exempt_test)
        ids, nodes = groups.setdefault((path, function), ([], []))
        ids.append(patch.id)
        if patch.exempt_test not in nodes:
            nodes.append(patch.exempt_test)
    return groups


#: exemption tests that are whole multi-rank training runs (Megatron-LM's pretrain_gpt.py,
#: train's checkpoint layouts): rerunning them with the patch off is left to tox, once per
#: megatron-core release (``--per-release``); the default suite already runs each of them
#: with the patch on
TRAINING_RUN_TESTS = (REPO / "tests" / "megatron_lm", REPO / "tests" / "training")


def _runs_training(group: tuple[Path, str]) -> bool:
    return any(group[0].is_relative_to(folder) for folder in TRAINING_RUN_TESTS)


def _pytest(*argv: str, **env: str) -> subprocess.CompletedProcess:
    """A fresh, single-process pytest run of this checkout with ``env`` added (the default tiers:
    no ``--extended``, no ``--per-release``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _not_failed(nodes: list[str], stdout: str) -> list[str]:
    """The nodes with no FAILED or ERROR line: a node pytest deselected or could not find leaves
    none, which proves nothing about the patch."""
    return [n for n in nodes if f"FAILED {n}" not in stdout and f"ERROR {n}" not in stdout]


def _batches(groups: list[tuple[Path, str]]) -> list[list[tuple[Path, str]]]:
    """``groups`` split into batches with at most one group per test file, so a file's
    module-level state never carries one group's switched-off patches into another's test."""
    batches: list[list[tuple[Path, str]]] = []
    for group in groups:
        batch = next((b for b in batches if all(g[0] != group[0] for g in b)), None)
        if batch is None:
            batches.append(batch := [])
        batch.append(group)
    return batches


@pytest.mark.slow
def test_exempt_tests_fail_with_their_patches_disabled(tmp_path):
    """Each exemption's test, run with ``MEGATRON_NPU_DISABLE=<its patch ids>``, must fail:
    otherwise it does not show that the patch is needed. The tests run a few to a process
    (``disable_per_test.py`` switches each one's patches off for it alone); a group the batch
    does not see fail is run once more on its own, and must fail there."""
    groups = _groups()
    quick = sorted(g for g in groups if not _runs_training(g))
    assert quick, "no exemption test outside the training runs: nothing to check"
    unproven: dict[tuple[Path, str], str] = {}
    for number, batch in enumerate(_batches(quick)):
        plan = {node: ",".join(groups[g][0]) for g in batch for node in groups[g][1]}
        plan_file = tmp_path / f"batch{number}.json"
        plan_file.write_text(json.dumps(plan))
        proc = _pytest(
            "-rA",
            "--no-header",
            "-p",
            "disable_per_test",
            *plan,
            PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]),
            DISABLE_PER_TEST=str(plan_file),
        )
        for group in batch:
            if _not_failed(groups[group][1], proc.stdout):
                unproven[group] = proc.stdout[-3000:]
    print(f"{len(unproven)} of {len(quick)} groups run again alone: {sorted(unproven)}")
    still = {}
    for group, batch_output in unproven.items():
        ids, nodes = groups[group]
        proc = _pytest("-rA", "--no-header", *nodes, MEGATRON_NPU_DISABLE=",".join(ids))
        if proc.returncode != 1 or _not_failed(nodes, proc.stdout):
            still[",".join(ids)] = f"{nodes}\n{batch_output}\n--- alone ---\n{proc.stdout[-3000:]}"
    assert not still, "not failing with their patches disabled:\n" + "\n".join(
        f"{ids}: {detail}" for ids, detail in still.items()
    )


@pytest.mark.slow
@pytest.mark.per_release
@pytest.mark.parametrize(
    "group",
    [pytest.param(g, id=f"{g[0].name}::{g[1]}") for g in sorted(_groups()) if _runs_training(g)],
)
def test_exempt_training_run_fails_with_its_patch_disabled(group):
    """The same for an exemption test that is a whole training run, one run per group."""
    ids, nodes = _groups()[group]
    proc = _pytest("-rA", "--no-header", *nodes, MEGATRON_NPU_DISABLE=",".join(ids))
    not_failed = _not_failed(nodes, proc.stdout)
    assert proc.returncode == 1 and not not_failed, (
        f"not failing with {','.join(ids)} disabled: {not_failed or nodes}\n{proc.stdout[-3000:]}"
    )


def test_exemption_tests_run_in_the_default_suite():
    """The test an exemption names runs in the default suite (with its patch on), not only in a
    tier the README's test command leaves out (``extended``, ``per_release``). Only the patches
    of the installed megatron-core: a test parametrised by the patches that apply here has no
    case for another release's patch (tox runs that one on its own release)."""
    installed = megatron_core_version()
    nodes = sorted({p.exempt_test for p in _exempt() if p.applies_to_version(installed)})
    proc = _pytest("--collect-only", *nodes)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.strip() for line in proc.stdout.splitlines()}
    # a node is collected as itself, as its parametrised cases, or (``file::``) as its file's tests
    missing = [
        n
        for n in nodes
        if not any(
            c == n or c.startswith(n + "[") or (n.endswith("::") and c.startswith(n))
            for c in collected
        )
    ]
    assert not missing, f"exemption tests the default suite leaves out: {missing}"


def test_each_batched_test_sees_only_its_own_disabled_patches(tmp_path):
    """The batch plugin switches off, for each test, the patches its plan names, nothing for a
    test the plan leaves out, and leaves no setting behind."""
    (tmp_path / "test_plan.py").write_text(
        "import os\n\n"
        "def _seen():\n"
        "    return os.environ.get('MEGATRON_NPU_DISABLE')\n\n"
        "def test_a():\n    assert _seen() == 'p.one,p.two'\n\n"
        "def test_b():\n    assert _seen() == ''\n\n"
        "import pytest\n\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_c(x):\n    assert _seen() == 'p.three'\n"
    )
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"test_plan.py::test_a": "p.one,p.two", "test_plan.py::test_c": "p.three"})
    )
    env = {**os.environ, "PYTHONPATH": str(HERE), "DISABLE_PER_TEST": str(plan)}
    env.pop("MEGATRON_NPU_DISABLE", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "-q",
            "-p",
            "disable_per_test",
            "--rootdir",
            str(tmp_path),
            "-c",
            "/dev/null",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:]
