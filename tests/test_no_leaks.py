"""The adaptor leaves nothing behind: restore() undoes copies made after apply(), ``info`` leaves
the process as it found it, the torch_npu emulation is never mistaken for an installed torch_npu,
and parsing ``--disable-patch`` writes no environment."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import textwrap

import pytest

import megatron_npu
from megatron_npu import devices, patcher
from megatron_npu.devices import npu
from megatron_npu.ops.kernels import npu_kernels
from megatron_npu.registry import Patch, all_patches

GELU = "megatron.core.fusions.fused_bias_gelu"


@pytest.fixture
def import_dir(tmp_path, monkeypatch):
    """A folder on sys.path for modules the test writes; they are dropped from sys.modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    megatron_npu.restore()
    for name in set(sys.modules) - before:
        if name.startswith(("leakcheck", "fakemeg2")):
            del sys.modules[name]
    importlib.invalidate_caches()


def _write(folder, relpath: str, text: str) -> None:
    path = folder / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_from_import_copy_taken_after_apply_of_a_real_megatron_patch_is_restored(import_dir):
    gelu = importlib.import_module(GELU)
    original = gelu.bias_gelu_impl
    _write(import_dir, "leakcheck_user.py", f"from {GELU} import bias_gelu_impl\n")
    megatron_npu.apply("cpu")
    assert gelu.bias_gelu_impl is not original
    user = importlib.import_module("leakcheck_user")
    assert user.bias_gelu_impl is gelu.bias_gelu_impl  # it copied the replacement
    megatron_npu.restore()
    assert gelu.bias_gelu_impl is original
    assert user.bias_gelu_impl is original


def test_later_copies_through_aliases_relative_imports_and_re_exports_are_restored(import_dir):
    _write(import_dir, "fakemeg2/__init__.py", "")
    _write(import_dir, "fakemeg2/core/__init__.py", "")
    _write(import_dir, "fakemeg2/core/thing.py", "def f(x, y=1):\n    return ('original', x, y)\n")
    thing = importlib.import_module("fakemeg2.core.thing")
    original = thing.f
    # written now, imported only while applied
    _write(import_dir, "fakemeg2/core/reexport.py", "from .thing import f as g\n")
    _write(import_dir, "leakcheck_chain.py", "from fakemeg2.core.reexport import g as h\n")
    _write(import_dir, "leakcheck_home.py", "def replacement(x, y=1):\n    return ('new', x, y)\n")
    home = importlib.import_module("leakcheck_home")
    _write(  # imports the replacement from where it lives: not a copy of the Megatron name
        import_dir, "leakcheck_own.py", "from leakcheck_home import replacement as f\n"
    )
    megatron_npu.apply(
        "cpu",
        patches=[Patch("t.f", "fakemeg2.core.thing.f", home.replacement, "test")],
        megatron_version="0.15.0",
    )
    reexport = importlib.import_module("fakemeg2.core.reexport")
    chain = importlib.import_module("leakcheck_chain")
    own = importlib.import_module("leakcheck_own")
    assert reexport.g is chain.h is own.f is home.replacement
    megatron_npu.restore()
    assert thing.f is original and reexport.g is original and chain.h is original
    assert own.f is home.replacement  # left alone: it never came from the patched module


def _patch_table() -> dict[str, object]:
    """What every registry target is bound to right now, plus the device layer's state."""
    table: dict[str, object] = {}
    for patch in all_patches():
        try:
            owner, name = patcher.resolve(patch.target)
        except (ImportError, AttributeError):
            continue
        table[patch.target] = patcher._raw_attribute(owner, name)[0]
    table["<device>"] = devices.active()
    table["<kernels>"] = npu_kernels()
    table["<patcher>"] = (patcher.active_device(), [r.as_dict() for r in patcher.results()])
    table["<torch_npu>"] = sys.modules.get("torch_npu")
    return table


@pytest.mark.parametrize("device", ["cpu", "npu-emulated"])
def test_info_collect_leaves_the_process_as_it_found_it(device):
    from megatron_npu import info

    megatron_npu.restore()
    before = _patch_table()
    data = info.collect(device)
    assert sum(row["status"] == "applied" for row in data["patches"]) > 0
    after = _patch_table()
    assert after.keys() == before.keys()
    changed = [key for key in before if after[key] is not before[key] and after[key] != before[key]]
    assert changed == []


def test_info_collect_puts_back_an_earlier_application():
    from megatron_npu import info

    megatron_npu.restore()
    try:
        megatron_npu.apply("cpu")
        before = _patch_table()
        info.collect("npu-emulated")
        after = _patch_table()
        assert after["<patcher>"] == before["<patcher>"]
        assert after["<device>"].name == "cpu" and after["<kernels>"] is None
    finally:
        megatron_npu.restore()


def test_emulated_torch_npu_is_not_discoverable_as_installed_torch_npu():
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed here")
    megatron_npu.restore()
    try:
        megatron_npu.apply("npu-emulated")
        assert getattr(npu_kernels(), "IS_EMULATION", False) is True  # the NPU path is routed
        assert "torch_npu" not in sys.modules
        assert importlib.util.find_spec("torch_npu") is None
        assert npu.torch_npu_installed() is False
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("torch_npu")
        assert devices.detect() == "cpu"
    finally:
        megatron_npu.restore()


def test_parsing_disable_patch_writes_no_environment_and_the_disable_still_applies(
    monkeypatch, capsys
):
    import json

    from megatron_npu import cli

    monkeypatch.delenv(patcher.DISABLE_FLAG_ENV, raising=False)
    patch_id = all_patches()[0].id
    environ = dict(os.environ)
    args = cli.build_parser().parse_args(["info", "--device", "cpu", "--disable-patch", patch_id])
    assert args.disable_patch == [patch_id]
    assert dict(os.environ) == environ
    assert cli.main(["info", "--device", "cpu", "--json", "--disable-patch", patch_id]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["patches"]}
    assert rows[patch_id]["status"] == "disabled"
    assert dict(os.environ) == environ  # published only while the command ran


def test_train_sees_the_disable_flag_while_it_runs_and_the_environment_is_put_back(monkeypatch):
    from megatron_npu import cli

    monkeypatch.setenv(patcher.DISABLE_FLAG_ENV, "earlier")
    patch_id = all_patches()[0].id
    seen = {}

    def train(args):
        seen["env"] = os.environ.get(patcher.DISABLE_FLAG_ENV)
        seen["reasons"] = patcher.disabled_patches(known=[patch_id])
        return 0

    monkeypatch.setattr(cli, "_train", train)
    assert cli.main(["train", "--num-layers", "2", "--disable-patch", patch_id]) == 0
    assert seen == {"env": patch_id, "reasons": {patch_id: "disabled by --disable-patch"}}
    assert os.environ[patcher.DISABLE_FLAG_ENV] == "earlier"
