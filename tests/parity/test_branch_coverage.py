"""Branch coverage of the adaptor's numerics during a parity run, and truthful NPU cells.

The quick examples of every single-process parity cell (fp32 and fp16, on ``cpu`` and
``npu-emulated``; the attention cells on ``cpu`` once more with the C++ band forward switched
off, the fallback where it cannot be built) run under coverage.py with ``branch=True`` over
``megatron_npu/ops``, ``patches``, ``modules`` and ``optim``, in a fresh process
(``_coverage_trace.py``; nothing cached by earlier tests), and the share is read through
coverage's public API (its JSON report), less the patch modules whose every entry is
parity-exempt. The share of branches taken must
stay at or above :data:`FLOOR`, measured when the examples were made to reach every branch of
the patched code (windowed attention blocks, dropout, zero-centred gamma, per-batch rotary
frequencies ...); a case that stops reaching its code drops below it. Multi-rank cells run in
rank-pool workers and are not traced here (the TP/PP/DP branches of cross entropy, the grad
norm and the communication patches are theirs), except those of a patch with no single-process
layout (context parallelism), whose workers coverage measures too.

The same run counts the emulated torch_npu kernel calls of each npu-emulated cell: a patch
that declares ``npu_kernels`` in the registry must call exactly those, and one that declares
none must call none (``info`` says "same code as cpu" for it). It also records where each call
came from: every place in the package that calls a torch_npu kernel must be among them, so each
one has bound against torch_npu's own schema (the emulation checks every call,
:mod:`megatron_npu.devices.torch_npu_schema`).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: the share of branches taken by the quick examples (fp32 + fp16, cpu + npu-emulated, world size
#: 1 and the context-parallel pools, see the module doc) once they reach every branch they can:
#: 616 of 876 (0.703). The rest are multi-rank branches (TP/PP/DP collectives, sequence
#: parallelism), argument checks that raise, and the emulation's refusals of unsupported forms.
FLOOR = 0.69


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(coverage data file, cells.json contents) of a fresh-process trace."""
    out = tmp_path_factory.mktemp("branch-coverage")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "_coverage_trace.py"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out / "coverage.dat", json.loads((out / "cells.json").read_text())


def parity_exempt_patch_modules() -> list[Path]:
    """The ``megatron_npu/patches`` modules whose every entry is parity-exempt (the training
    layer's plumbing: checkpointing, pipeline outputs, Megatron-LM's arguments, eager jit
    fusions, RNG, tensor methods). No parity case is meant to reach them -- each entry names the
    test that does -- so they are left out of the share the parity examples must reach."""
    import importlib
    import pkgutil

    import megatron_npu.patches as patches

    found = []
    for info in pkgutil.iter_modules(patches.__path__):
        entries = getattr(importlib.import_module(f"{patches.__name__}.{info.name}"), "PATCHES", [])
        if entries and all(p.parity_exempt and not p.parity for p in entries):
            found.append(Path(patches.__path__[0]) / f"{info.name}.py")
    return found


def branch_share(data_file: Path, report: Path) -> tuple[float, int, int]:
    """Branches taken / branches, over the measured files less the parity-exempt patch modules,
    through coverage's public API (its JSON report's totals)."""
    import coverage  # a test dependency: a missing one must fail, not skip

    cov = coverage.Coverage(data_file=str(data_file), branch=True)
    cov.load()
    cov.json_report(outfile=str(report), omit=[str(p) for p in parity_exempt_patch_modules()])
    totals = json.loads(report.read_text())["totals"]
    taken, total = totals["covered_branches"], totals["num_branches"]
    return taken / max(total, 1), taken, total


def test_parity_examples_reach_the_branches_of_the_patched_code(traced, tmp_path):
    data_file, cells = traced
    assert not cells["errors"], f"parity cells in error: {cells['errors']}"
    share, taken, total = branch_share(data_file, tmp_path / "coverage.json")
    print(f"branch coverage: {taken}/{total} = {share:.3f}")
    assert share >= FLOOR, f"branch coverage {taken}/{total} = {share:.3f} fell below {FLOOR}"


def test_npu_cells_call_the_kernels_the_registry_declares(traced):
    """A patch's npu-emulated cells call exactly the kernels it declares; a whole-module case
    (the MoE layer) calls its own and, on its way, only kernels other patches declare."""
    from megatron_npu.parity.case import load_case

    from megatron_npu.registry import all_patches

    kernels = traced[1]["kernels"]
    assert kernels, "the trace recorded no npu-emulated cell"
    declared_anywhere = {k for p in all_patches() for k in p.npu_kernels}
    for patch in all_patches():
        if patch.id not in kernels:
            continue
        called, declared = set(kernels[patch.id]), set(patch.npu_kernels)
        detail = f"{patch.id}: npu-emulated cells called {sorted(called)}, the registry declares "
        if load_case(patch.parity).whole_module:
            assert declared <= called <= declared_anywhere, detail + str(sorted(declared))
        else:
            assert called == declared, detail + str(sorted(declared))


def kernel_call_sites() -> set[tuple[str, int, str]]:
    """Every ``<module>.npu_<kernel>(...)`` call in the package outside the emulation, as
    (file, line, kernel), for the kernels the pinned torch_npu has."""
    import megatron_npu
    from megatron_npu.devices import torch_npu_schema

    known = torch_npu_schema.kernel_names()
    package = Path(megatron_npu.__file__).resolve().parent
    sites = set()
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "testing":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in known
            ):
                sites.add((str(path), node.lineno, node.func.attr))
    return sites


def test_every_kernel_the_package_calls_is_emulated_and_declared():
    from megatron_npu.registry import all_patches
    from megatron_npu.testing import torch_npu_emulation

    called = {kernel for _, _, kernel in kernel_call_sites()}
    assert called, "found no torch_npu kernel call in the package"
    emulated = set(torch_npu_emulation.KERNELS)
    assert called <= emulated, f"not emulated: {sorted(called - emulated)}"
    declared = {k for p in all_patches() for k in p.npu_kernels}
    assert called <= declared, f"called but in no registry entry: {sorted(called - declared)}"


def _executed_in_rank_pools(data_file: Path, sites) -> set[tuple[str, int, str]]:
    """The kernel call sites whose line ran in the trace's rank-pool workers (their coverage is
    combined into ``data_file``): a line of ``<module>.npu_<kernel>(...)`` runs only where the op
    layer holds a kernel module, so it called the kernel, which bound against the schema."""
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    lines = {path: set(data.lines(path) or ()) for path in data.measured_files()}
    return {site for site in sites if site[1] in lines.get(site[0], ())}


def test_every_kernel_call_site_binds_against_the_real_schema(traced):
    sites = kernel_call_sites()
    reached = {tuple(site) for site in traced[1]["call_sites"]}
    reached |= _executed_in_rank_pools(traced[0], sites)
    print(f"kernel call sites reached: {len(sites & reached)}/{len(sites)}")
    assert sites <= reached, f"never called in the parity trace: {sorted(sites - reached)}"
