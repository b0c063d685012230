"""What ``pip install .`` puts into site-packages, and what an installed package does at run time.

One top-level name: the repository's ``parity/`` and ``reports/`` folders install as
``megatron_npu.parity`` and ``megatron_npu.reports``; ``perf/`` and ``tests/`` stay in the
checkout. Provenance runs git only in this package's own source checkout, and
``megatron-npu parity`` names the extra it needs instead of failing inside pytest.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import megatron_npu.parity.provenance as provenance
import megatron_npu.parity.runner as runner
import pytest

import megatron_npu

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as stream:
        return tomllib.load(stream)["tool"]["setuptools"]


def _package_folder(package: str, package_dir: dict[str, str]) -> Path:
    """The checkout folder a dotted package is built from (pyproject's package-dir mapping)."""
    for prefix in sorted(package_dir, key=len, reverse=True):
        if package == prefix or package.startswith(prefix + "."):
            rest = package[len(prefix) :].lstrip(".").split(".") if package != prefix else []
            return ROOT / package_dir[prefix] / Path(*rest) if rest else ROOT / package_dir[prefix]
    return ROOT / Path(*package.split("."))


def test_the_package_list_covers_every_folder_of_the_installed_packages():
    config = _setuptools_config()
    listed = {_package_folder(name, config["package-dir"]) for name in config["packages"]}
    on_disk = {
        init.parent
        for folder in ("megatron_npu", "parity", "reports")
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert sorted(map(str, on_disk - listed)) == [], "add these packages to pyproject.toml"
    assert sorted(map(str, listed - on_disk)) == [], "listed packages without a folder"
    assert all(name.split(".")[0] == "megatron_npu" for name in config["packages"])


def _source_copy(target: Path) -> Path:
    """The checkout's files as git would see them, without build outputs: setuptools builds in
    ``build/`` of the source folder and would carry stale files of an earlier layout along."""
    ignore = shutil.ignore_patterns(
        ".git",
        ".venv",
        ".tox",
        "build",
        "dist",
        "*.egg-info",
        "runs",
        "results",
        "__pycache__",
        ".hypothesis",
        ".benchmarks",
        ".pytest_cache",
        ".ruff_cache",
    )
    shutil.copytree(ROOT, target, ignore=ignore, symlinks=True)
    return target


@pytest.mark.slow
def test_pip_install_into_a_clean_venv_installs_one_top_level_package(tmp_path):
    """The real ``pip install .`` (no dependencies), read from the installed files."""
    source = _source_copy(tmp_path / "src")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    installed = {
        path.name
        for path in site.iterdir()
        if not path.name.endswith((".dist-info", ".pth")) and path.name != "__pycache__"
    }
    ours = installed - {"pip", "_distutils_hack", "setuptools", "pkg_resources"}
    assert ours == {"megatron_npu"}
    package = site / "megatron_npu"
    assert (package / "parity" / "cells_test.py").is_file()
    assert (package / "parity" / "cases" / "norm.py").is_file()
    assert (package / "reports" / "build.py").is_file()
    assert list((package / "reports" / "templates").iterdir()), "the report templates ship"
    assert (package / "compare" / "default_matrix.toml").is_file()
    assert (package / "devices" / "torch_npu_schemas.txt").is_file(), "the kernel schemas ship"
    assert not (package / "perf").exists() and not (site / "tests").exists()


def _fake_package(monkeypatch, folder: Path) -> None:
    (folder / "megatron_npu").mkdir(parents=True)
    monkeypatch.setattr(megatron_npu, "__file__", str(folder / "megatron_npu" / "__init__.py"))


def test_provenance_runs_git_only_in_its_own_source_checkout(tmp_path, monkeypatch):
    calls = []
    real_run = subprocess.run

    def counting_run(argv, **kwargs):
        calls.append(argv)
        return real_run(argv, **kwargs)

    monkeypatch.setattr(provenance.subprocess, "run", counting_run)
    # this checkout: git runs and reads its commit
    assert provenance.source_checkout() == ROOT
    # an installed package in a folder that happens to be someone's git repository
    site = tmp_path / "site-packages"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, capture_output=True)
    _fake_package(monkeypatch, site)
    assert provenance.source_checkout() is None
    calls.clear()
    assert provenance.git_info() is None and calls == []
    # a pyproject of another project above the package is not ours either
    other = tmp_path / "other"
    _fake_package(monkeypatch, other)
    (other / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert provenance.source_checkout() is None and provenance.git_info() is None and calls == []
    # our own pyproject: a source checkout, git runs there
    ours = tmp_path / "ours"
    _fake_package(monkeypatch, ours)
    (ours / "pyproject.toml").write_text('[project]\nname = "megatron-npu"\n')
    assert provenance.source_checkout() == ours
    assert provenance.git_info() is not None and calls


def test_provenance_records_the_package_version(tmp_path):
    import hypothesis

    prov = provenance.collect_provenance("cpu", seed=1, wall_time_s=0.1, repo_dir=tmp_path)
    assert prov.megatron_npu == megatron_npu_version()
    # which examples a case draws depends on the Hypothesis release too
    assert prov.hypothesis == hypothesis.__version__


def megatron_npu_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("megatron-npu")


def test_parity_names_the_extra_it_needs(monkeypatch, tmp_path):
    real_find_spec = runner.importlib.util.find_spec
    monkeypatch.setattr(
        runner.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "hypothesis" else real_find_spec(name, *a),
    )
    args = argparse.Namespace(
        workers=2, devices=["cpu"], mode="quick", results=str(tmp_path), keyword=None
    )
    with pytest.raises(SystemExit, match=r"needs hypothesis.*megatron-npu\[parity\]"):
        runner.main(args)
    assert list(tmp_path.iterdir()) == [], "nothing is written before the check"
    assert runner.missing_requirements(1) == ["hypothesis"]


def test_the_parity_extra_holds_what_the_runner_imports():
    with (ROOT / "pyproject.toml").open("rb") as stream:
        extras = tomllib.load(stream)["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("=")[0].split("[")[0].strip() for req in extras["parity"]}
    needed = set(runner.REQUIRED.values()) | set(runner.REQUIRED_FOR_WORKERS.values())
    assert needed <= names
