"""The CI gates are really set: a per-test timeout, pybind11 for the helpers_cpp identity tests,
and a branch-coverage floor measured through coverage's public API in a fresh process."""

from __future__ import annotations

import ast
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _test_extra() -> set[str]:
    names = set()
    for requirement in PYPROJECT["project"]["optional-dependencies"]["test"]:
        name = requirement.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.add(name.lower())
    return names


def test_every_test_has_a_timeout(pytestconfig):
    """pytest-timeout is installed with the tests and a global limit is configured (and in
    effect in this very run)."""
    assert "pytest-timeout" in _test_extra()
    configured = float(PYPROJECT["tool"]["pytest"]["ini_options"]["timeout"])
    assert 0 < configured <= 1800
    assert float(pytestconfig.getini("timeout")) == configured


def test_the_helpers_cpp_build_is_a_test_dependency():
    """The byte-identity tests against Megatron's C++ helpers build them with pybind11 where the
    wheel ships none; a missing pybind11 would have skipped them silently."""
    import pybind11  # noqa: F401  (installed by the test extra)

    assert "pybind11" in _test_extra()
    source = (ROOT / "tests" / "data" / "test_data_index_helpers.py").read_text()
    assert "pytest.skip" not in source and "importorskip" not in source


def test_branch_coverage_uses_only_coverage_public_api():
    """No private coverage.py attribute (``cov._analyze`` and the like) in the coverage gate,
    and the trace runs in a subprocess (order-independent)."""
    paths = [
        ROOT / "tests" / "parity" / n for n in ("test_branch_coverage.py", "_coverage_trace.py")
    ]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert not node.attr.startswith("_") or node.attr.startswith("__"), (
                    f"{path.name}:{node.lineno} uses the private attribute {node.attr}"
                )
    assert "subprocess.run" in paths[0].read_text()
