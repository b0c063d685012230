"""Each registry rule, checked on a synthetic module so a broken rule fails here."""

from __future__ import annotations

import functools
import sys
import types

import pytest

import megatron_npu
from megatron_npu import patcher
from megatron_npu.patcher import PatchSignatureError, PatchTargetError
from megatron_npu.registry import Patch

VERSION = "0.15.0"


def _original_f(x, y=1):
    return ("original", x, y)


def _replacement_f(x, y=1):
    return ("replaced", x, y)


class _Base:
    def method(self, a):
        return ("base", a)

    @staticmethod
    def helper(a, b=2):
        return ("static", a, b)


@pytest.fixture
def fake():
    """``fakemeg.core.thing`` with a function, a class, and a module that copied the function."""
    pkg = types.ModuleType("fakemeg")
    pkg.__path__ = []
    core = types.ModuleType("fakemeg.core")
    core.__path__ = []
    thing = types.ModuleType("fakemeg.core.thing")
    thing.f = _original_f

    class Config(_Base):
        pass

    thing.Config = Config
    user = types.ModuleType("fakemeg_user")  # did `from fakemeg.core.thing import f` earlier
    user.f = thing.f
    modules = {"fakemeg": pkg, "fakemeg.core": core, "fakemeg.core.thing": thing}
    modules["fakemeg_user"] = user
    sys.modules.update(modules)
    yield types.SimpleNamespace(thing=thing, user=user, Config=Config)
    for name in modules:
        sys.modules.pop(name, None)


def _apply(patches, device="cpu", **kw):
    return megatron_npu.apply(device, patches=patches, megatron_version=VERSION, **kw)


def _counting_wrap(original):
    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return ("wrapped", original(*args, **kwargs))

    return wrapped


def test_replace_and_restore_identity(fake):
    original = fake.thing.f
    results = _apply([Patch("t.f", "fakemeg.core.thing.f", _replacement_f, "test")])
    assert [r.status for r in results] == ["applied"]
    assert fake.thing.f(3)[0] == "replaced"
    megatron_npu.restore()
    assert fake.thing.f is original


def test_double_apply_and_device_switch_never_stack_wrappers(fake):
    patch = Patch("t.wrap", "fakemeg.core.thing.f", _counting_wrap, "test", kind="wrap")
    _apply([patch])
    first = fake.thing.f
    _apply([patch])
    assert fake.thing.f is first, "second apply for the same device must be a no-op"
    _apply([patch], device="npu-emulated")
    assert fake.thing.f(1) == ("wrapped", ("original", 1, 1)), "wrapper stacked on re-apply"
    megatron_npu.restore()
    assert fake.thing.f is _original_f


def test_a_wrap_that_keeps_the_original_is_reported_as_kept(fake):
    """A wrap may find nothing to replace (its builder returns the target itself): nothing is
    bound, and the status says so instead of ``applied``."""
    kept = Patch("t.kept", "fakemeg.core.thing.f", lambda original: original, "when f is slow",
                 kind="wrap")  # fmt: skip
    results = _apply([kept, Patch("t.m", "fakemeg.core.thing.Config.method", _counting_wrap,
                                  "test", kind="wrap")])  # fmt: skip
    assert [r.status for r in results] == [patcher.KEPT_ORIGINAL, patcher.APPLIED]
    assert results[0].reason == (
        f"the target stays as found ({__name__}._original_f); the patch is for: when f is slow"
    )
    assert results[0].sites == 0
    assert fake.thing.f is _original_f and "f" in vars(fake.thing)
    megatron_npu.restore()
    assert fake.thing.f is _original_f and fake.user.f is _original_f


def test_from_import_copies_are_rebound_and_restored(fake):
    _apply([Patch("t.f", "fakemeg.core.thing.f", _replacement_f, "test")])
    assert fake.user.f is _replacement_f
    megatron_npu.restore()
    assert fake.user.f is _original_f


def test_missing_target_names_patch_target_and_version_and_creates_nothing(fake):
    patch = Patch("t.missing", "fakemeg.core.thing.not_there", _replacement_f, "test")
    with pytest.raises(PatchTargetError) as err:
        _apply([patch])
    message = str(err.value)
    assert "t.missing" in message
    assert "fakemeg.core.thing.not_there" in message
    assert VERSION in message
    assert not hasattr(fake.thing, "not_there")
    assert patcher.active_device() is None


def test_missing_module_is_a_target_error(fake):
    with pytest.raises(PatchTargetError, match="fakemeg.core.gone.f"):
        _apply([Patch("t.gone", "fakemeg.core.gone.f", _replacement_f, "test")])


def test_version_range_excluding_installed_version_skips(fake):
    patch = Patch("t.old", "fakemeg.core.thing.not_there", _replacement_f, "test", versions="<0.14")
    results = _apply([patch])
    assert results[0].status == "skipped-by-version"
    assert VERSION in results[0].reason
    assert not hasattr(fake.thing, "not_there")


def test_signature_mismatch_is_refused_and_nothing_stays_patched(fake):
    def wrong(x, z=1):
        return x

    good = Patch("t.good", "fakemeg.core.thing.Config.method", lambda self, a: a, "test")
    bad = Patch("t.bad", "fakemeg.core.thing.f", wrong, "test")
    with pytest.raises(PatchSignatureError, match=r"t\.bad.*\(x, z=1\).*\(x, y=1\)"):
        _apply([good, bad])
    assert fake.thing.f is _original_f
    assert "method" not in vars(fake.Config), "earlier patch must be rolled back"


def test_non_strict_records_failure_and_keeps_going(fake):
    bad = Patch("t.bad", "fakemeg.core.thing.f", lambda q: q, "test")
    good = Patch("t.good", "fakemeg.core.thing.Config.method", lambda self, a: ("p", a), "test")
    results = _apply([bad, good], strict=False)
    assert [r.status for r in results] == ["failed", "applied"]
    assert "signature" in results[0].reason


def test_device_filter(fake):
    patch = Patch(
        "t.npu-only", "fakemeg.core.thing.f", _replacement_f, "test", devices=frozenset({"npu"})
    )
    assert _apply([patch])[0].status == "not-for-this-device"
    assert fake.thing.f is _original_f


def test_subclass_defined_after_apply_gets_patched_method(fake):
    _apply([Patch("t.m", "fakemeg.core.thing.Config.method", lambda self, a: ("p", a), "test")])

    class Later(fake.Config):
        pass

    assert Later().method(1) == ("p", 1)
    megatron_npu.restore()
    assert Later().method(1) == ("base", 1)
    assert "method" not in vars(fake.Config), "inherited attribute must be removed, not set"


def test_staticmethod_descriptor_is_kept_and_restored(fake):
    raw = vars(_Base)["helper"]
    fake.thing._Base = _Base
    _apply([Patch("t.s", "fakemeg.core.thing._Base.helper", _counting_wrap, "t", kind="wrap")])
    assert _Base.helper(1) == ("wrapped", ("static", 1, 2))
    assert isinstance(vars(_Base)["helper"], staticmethod)
    megatron_npu.restore()
    assert vars(_Base)["helper"] is raw


def test_real_megatron_subclass_after_apply_is_patched():
    """A subclass of Megatron's TransformerConfig defined after apply runs the patched hook."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    seen = []

    def wrap_post_init(original):
        @functools.wraps(original)
        def post_init(self):
            seen.append(type(self).__name__)
            return original(self)

        return post_init

    patch = Patch(
        "t.cfg",
        f"{TransformerConfig.__module__}.TransformerConfig.__post_init__",
        wrap_post_init,
        "test",
        kind="wrap",
    )
    megatron_npu.apply("cpu", patches=[patch])

    class MyConfig(TransformerConfig):
        pass

    MyConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert seen == ["MyConfig"]
    megatron_npu.restore()
    MyConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert seen == ["MyConfig"]


def test_registry_rejects_bad_entries():
    with pytest.raises(ValueError, match="kind"):
        Patch("x", "a.b", None, "r", kind="monkey")
    with pytest.raises(ValueError, match="unknown devices"):
        Patch("x", "a.b", None, "r", devices=frozenset({"tpu"}))
    with pytest.raises(ValueError, match="version specifier"):
        Patch("x", "a.b", None, "r", versions="~~1")


# --- per-patch off switch ------------------------------------------------------------------


def test_disable_argument_leaves_patch_out_and_reports_it(fake):
    keep = Patch("t.m", "fakemeg.core.thing.Config.method", lambda self, a: ("p", a), "test")
    off = Patch("t.f", "fakemeg.core.thing.f", _replacement_f, "test")
    results = _apply([keep, off], disable=("t.f",))
    assert [(r.id, r.status) for r in results] == [("t.m", "applied"), ("t.f", "disabled")]
    assert results[1].reason == "disabled by apply(disable=...)"
    assert fake.thing.f is _original_f and fake.user.f is _original_f
    assert fake.Config().method(1) == ("p", 1)
    # the disabled set is part of what apply() is idempotent on
    assert [r.status for r in _apply([keep, off])] == ["applied", "applied"]
    assert fake.thing.f is _replacement_f


def test_disable_environment_variable(fake, monkeypatch):
    monkeypatch.setenv(patcher.DISABLE_ENV, " t.f , ")
    results = _apply([Patch("t.f", "fakemeg.core.thing.f", _replacement_f, "test")])
    assert (results[0].status, results[0].reason) == (
        "disabled",
        "disabled by MEGATRON_NPU_DISABLE",
    )
    assert fake.thing.f is _original_f


def test_disable_unknown_id_is_an_error_naming_it(fake, monkeypatch):
    patch = Patch("t.f", "fakemeg.core.thing.f", _replacement_f, "test")
    with pytest.raises(patcher.UnknownPatchError, match="'t.typo'"):
        _apply([patch], disable=("t.typo",))
    monkeypatch.setenv(patcher.DISABLE_ENV, "t.other")
    with pytest.raises(patcher.UnknownPatchError, match=r"'t.other' \(MEGATRON_NPU_DISABLE\)"):
        _apply([patch])
    assert fake.thing.f is _original_f and patcher.active_device() is None


def test_disable_patch_flag_reaches_info(monkeypatch, capsys):
    import json

    from megatron_npu import cli
    from megatron_npu.registry import all_patches

    monkeypatch.setenv(patcher.DISABLE_FLAG_ENV, "")  # the command publishes its ids here
    first, second = (p.id for p in all_patches()[:2])
    argv = [
        "info",
        "--device",
        "cpu",
        "--json",
        "--disable-patch",
        first,
        "--disable-patch",
        second,
    ]
    assert cli.main(argv) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["patches"]}
    for patch_id in (first, second):
        assert rows[patch_id]["status"] == "disabled"
        assert rows[patch_id]["reason"] == "disabled by --disable-patch"
    assert sum(r["status"] == "applied" for r in rows.values()) > 0


def test_disable_patch_flag_rejects_unknown_id(capsys):
    from megatron_npu import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["info", "--device", "cpu", "--disable-patch", "no.such.patch"])
    assert exit_info.value.code == 2
    assert "no patch has id 'no.such.patch'" in capsys.readouterr().err


# --- any failure during apply() restores; wrap products are signature-checked ----------------


def _raising_wrap(original):
    raise ValueError("factory blew up")


def test_any_exception_from_a_wrap_factory_restores_everything(fake):
    good = Patch("t.good", "fakemeg.core.thing.Config.method", lambda self, a: ("p", a), "test")
    bad = Patch("t.bad", "fakemeg.core.thing.f", _raising_wrap, "test", kind="wrap")
    with pytest.raises(megatron_npu.PatchError, match=r"'t\.bad'.*ValueError: factory blew up"):
        _apply([good, bad])
    assert "method" not in vars(fake.Config) and fake.thing.f is _original_f
    assert patcher.active_device() is None
    results = _apply([good, bad], strict=False)  # non-strict: recorded, the rest applies
    assert [r.status for r in results] == ["applied", "failed"]
    assert "ValueError: factory blew up" in results[1].reason


def test_interrupt_during_apply_restores_and_propagates(fake):
    def interrupted(original):
        raise KeyboardInterrupt

    good = Patch("t.good", "fakemeg.core.thing.f", _replacement_f, "test")
    bad = Patch("t.int", "fakemeg.core.thing.Config.method", interrupted, "test", kind="wrap")
    with pytest.raises(KeyboardInterrupt):
        _apply([good, bad])
    assert fake.thing.f is _original_f and fake.user.f is _original_f
    assert patcher.active_device() is None


def test_wrap_product_with_other_parameters_is_refused(fake):
    def wrong_wrap(original):
        def wrapped(x, z=1):  # the target takes (x, y=1)
            return original(x, z)

        return wrapped

    with pytest.raises(PatchSignatureError, match=r"t\.w.*\(x, z=1\).*\(x, y=1\)"):
        _apply([Patch("t.w", "fakemeg.core.thing.f", wrong_wrap, "test", kind="wrap")])
    assert fake.thing.f is _original_f


def test_wrap_pass_through_must_declare_what_it_wraps(fake):
    def undeclared(original):
        def wrapped(*args, **kwargs):
            return original(*args, **kwargs)

        return wrapped

    with pytest.raises(PatchSignatureError):
        _apply([Patch("t.u", "fakemeg.core.thing.f", undeclared, "test", kind="wrap")])
    # the same pass-through with functools.wraps is accepted
    results = _apply([Patch("t.d", "fakemeg.core.thing.f", _counting_wrap, "test", kind="wrap")])
    assert results[0].status == "applied" and fake.thing.f(2) == ("wrapped", ("original", 2, 1))


# --- data index patches without a compiled helpers_cpp ---------------------------------------


def test_data_patches_apply_without_compiled_helpers(monkeypatch):
    import megatron.core.datasets as datasets_pkg
    import numpy

    from megatron_npu.patches import data

    args = (
        numpy.array([5, 3, 7, 2], dtype=numpy.int32),
        numpy.array([0, 2, 1, 3], dtype=numpy.int32),
        4,
        1,
        17,
        True,
        True,
    )
    helpers = sys.modules.get(data._HELPERS) or __import__(data._HELPERS, fromlist=["x"])
    expected = helpers.build_sample_idx(*args)  # megatron-core's compiled helpers

    # hide the compiled extension the way a wheel without it looks
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    monkeypatch.delitem(sys.modules, data._HELPERS)
    monkeypatch.delattr(datasets_pkg, "helpers", raising=False)
    stand_in = data.helpers_module()
    monkeypatch.setattr(datasets_pkg, "helpers", stand_in)  # undone after the test
    monkeypatch.setitem(sys.modules, data._HELPERS, stand_in)
    with pytest.raises(ImportError, match="helpers_cpp"):
        stand_in.build_sample_idx(*args)

    index_patches = [p for p in data.PATCHES if p.target.startswith(data._HELPERS + ".")]
    results = megatron_npu.apply("cpu", patches=index_patches)  # strict
    assert len(results) == 3 and {r.status for r in results} == {"applied"}
    from megatron.core.datasets import helpers as seen_by_megatron

    assert numpy.array_equal(seen_by_megatron.build_sample_idx(*args), expected)
    megatron_npu.restore()
    with pytest.raises(ImportError, match="helpers_cpp"):
        seen_by_megatron.build_sample_idx(*args)


def test_compile_helpers_needs_no_make(monkeypatch):
    import subprocess

    from megatron.core.datasets import utils

    def no_make(*args, **kwargs):
        raise AssertionError(f"compile_helpers ran a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_make)
    megatron_npu.apply("cpu")
    assert utils.compile_helpers() is None
    megatron_npu.restore()
    with pytest.raises(AssertionError, match="ran a subprocess"):
        utils.compile_helpers()  # megatron's own: runs make


def test_disable_patch_flag_on_train_reaches_the_ranks_environment(monkeypatch):
    import os

    from megatron_npu import cli
    from megatron_npu.registry import all_patches

    seen = {}
    monkeypatch.setenv(patcher.DISABLE_FLAG_ENV, "")

    def train(args):
        seen["argv"] = args.train_argv
        seen["env"] = os.environ[patcher.DISABLE_FLAG_ENV]  # inherited by launched ranks
        seen["reasons"] = patcher.disabled_patches(known=[patch_id])
        return 0

    monkeypatch.setattr(cli, "_train", train)
    patch_id = all_patches()[0].id
    cli.main(["train", "--num-layers", "2", "--disable-patch", patch_id, "--lr", "1e-3"])
    assert seen["argv"] == ["--num-layers", "2", "--lr", "1e-3"]  # Megatron's options untouched
    assert seen["env"] == patch_id
    assert seen["reasons"] == {patch_id: "disabled by --disable-patch"}
    assert os.environ[patcher.DISABLE_FLAG_ENV] == ""  # the command's run only


def test_what_a_factory_patch_builds_is_a_class_of_the_adaptor():
    import importlib

    from megatron_npu.registry import all_patches

    built = {b for p in all_patches() for b in p.builds}
    assert "megatron_npu.modules.norm.Norm" in built
    for dotted in built:
        module, name = dotted.rsplit(".", 1)
        assert dotted.startswith("megatron_npu.") and isinstance(
            getattr(importlib.import_module(module), name), type
        )
