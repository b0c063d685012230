"""``data.compile-helpers-cuda``: on a GPU with pip's megatron-core (its wheel ships the built
``helpers_cpp`` but no Makefile), Megatron-LM's ``compile_helpers`` runs ``make``, which stops,
and exits the run. The wrap builds where a Makefile is, and otherwise says in one line what
serves: the prebuilt extension, or the numpy helpers where that is missing too."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_npu.data import index_helpers
from megatron_npu.devices.facts import CUDA
from megatron_npu.patches import data
from megatron_npu.registry import all_patches


def _megatron_like(folder, makefile: bool):
    """A ``compile_helpers`` as Megatron's: it runs ``make`` in its own folder and exits 1 when
    that fails (here: it records the call and exits)."""
    (folder / "datasets_utils.py").write_text(
        "import sys\nCALLS = []\ndef compile_helpers():\n    CALLS.append('make')\n"
        "    sys.exit(1)\n"
    )
    if makefile:
        (folder / "Makefile").write_text("all:\n")
    spec = importlib.util.spec_from_file_location(
        "datasets_utils_under_test", folder / "datasets_utils.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_makefile_is_one_line_not_an_exit(capsys, monkeypatch):
    """Installed through the patcher (its device widened to this host's for the test; the
    switch ``MEGATRON_NPU_DISABLE`` is honoured): pip's megatron-core here has no Makefile, and
    ``make`` failing made Megatron exit."""
    import dataclasses
    import subprocess

    from megatron.core.datasets import utils

    import megatron_npu

    entry = {p.id: p for p in all_patches()}["data.compile-helpers-cuda"]
    here = dataclasses.replace(entry, devices=frozenset({"cpu"}))
    made = []
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: made.append(a) or subprocess.CompletedProcess(a, 2)
    )
    megatron_npu.apply("cpu", patches=[here])
    try:
        assert utils.compile_helpers() is None and made == []
    finally:
        megatron_npu.restore()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Makefile in" in err[0] and "prebuilt helpers_cpp serves" in err[0]


def test_without_the_extension_the_numpy_helpers_serve(tmp_path, capsys, monkeypatch):
    module = _megatron_like(tmp_path, makefile=False)
    installed = []
    monkeypatch.setattr(index_helpers, "install_numpy_helpers", lambda: installed.append(1))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.endswith("helpers_cpp") else real(name, *a),
    )
    assert data._compile_where_possible(module.compile_helpers)() is None
    assert module.CALLS == [] and installed == [1]
    assert "numpy index helpers serve" in capsys.readouterr().err


def test_with_a_makefile_megatrons_own_build_runs(tmp_path):
    module = _megatron_like(tmp_path, makefile=True)
    with pytest.raises(SystemExit):
        data._compile_where_possible(module.compile_helpers)()
    assert module.CALLS == ["make"]


def test_it_is_a_cuda_entry_only():
    entry = {p.id: p for p in all_patches()}["data.compile-helpers-cuda"]
    assert entry.devices == frozenset({CUDA}) and entry.kind == "wrap"
    assert "data.compile-helpers" in {p.id for p in all_patches()}
    assert CUDA not in {p.id: p for p in all_patches()}["data.compile-helpers"].devices
