"""The import graph of ``megatron_npu``, ``parity``, ``perf`` and ``reports``, read statically.

The repository's ``parity/`` and ``reports/`` folders are the packages ``megatron_npu.parity``
and ``megatron_npu.reports`` (pyproject's package-dir mapping); ``perf/`` is the top-level
``perf`` of a checkout. The rules below name them by folder: ``parity`` is
``megatron_npu.parity``, ``reports`` is ``megatron_npu.reports``, and the adaptor proper is the
rest of ``megatron_npu``. Nothing imports the folders under their bare names (``import parity``
would load a second copy in a checkout and fail in an installed wheel).

Every ``import`` / ``from ... import`` statement of every module counts, at module level or
inside a function (a lazy import is a dependency too: it only hides a circle until run time).
``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package``. An edge to a package's ``__init__`` is an edge to that package only, not to the
modules its ``__init__`` imports.

Rules:

1. No cycle between modules (a strongly connected component of more than one module).
2. Layers between the top-level packages: the adaptor proper (``megatron_npu`` outside its
   command layer ``cli``, ``compare``, ``evaluate``, ``info``, ``train``, ``training``) imports
   none of ``parity``, ``perf``, ``reports`` (the commands may: ``compare`` writes the report
   and reads parity records, ``cli`` dispatches ``megatron-npu parity``); ``parity`` imports
   neither ``perf`` nor ``reports``; ``perf`` does not import ``reports``.
3. Layers inside the adaptor: the foundation (``versions``, ``devices``, ``ops``, ``data``,
   ``modules``, ``optim``) imports none of the subsystems built on it (``patches``,
   ``training`` and the command layer); ``megatron_npu.data`` in particular never imports
   ``megatron_npu.training``. (``registry`` collects the ``patches`` modules' entries by design.)
   ``devices`` does not import ``registry`` either: what is known of a device, its name first,
   lives in ``devices`` (``megatron_npu.devices.facts``) and the registry reads it from there.

:data:`KNOWN_UPWARD` lists violations that are tolerated (it is empty); an entry that no longer
occurs fails the test, so the list can only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: folder of the checkout -> the dotted package it installs as
PACKAGES = {
    "megatron_npu": "megatron_npu",
    "parity": "megatron_npu.parity",
    "perf": "perf",
    "reports": "megatron_npu.reports",
}
#: the bare folder names nothing may import
BARE = ("parity", "reports")

#: (importer, imported) pairs that break a rule today, outside this test's owner's modules
KNOWN_UPWARD: set[tuple[str, str]] = set()

FOUNDATION = ("versions", "devices", "ops", "data", "modules", "optim")
COMMANDS = ("cli", "compare", "evaluate", "info", "locate", "train", "training")
SUBSYSTEMS = ("patches", *COMMANDS)
#: top-level package -> packages it must not import
FORBIDDEN_TOP = {
    "megatron_npu": {"parity", "perf", "reports"},
    "parity": {"perf", "reports"},
    "perf": {"reports"},
}


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of :data:`PACKAGES`."""
    out = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([dotted, *parts])] = path
    return out


def group(module: str) -> str:
    """The folder a dotted module lives in: ``megatron_npu``, ``parity``, ``perf``
    or ``reports``."""
    parts = module.split(".")
    if parts[0] == "megatron_npu" and len(parts) > 1 and parts[1] in BARE:
        return parts[1]
    return parts[0]


def bare_imports() -> list[str]:
    """``file:line`` of every statement that imports ``parity`` or ``reports`` by its bare name."""
    found = []
    for path in module_names().values():
        source = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(ROOT)}:{line}" for line in bare_import_lines(source)]
    return found


#: calls that take a package by name
LOADERS = {
    "import_module",
    "find_spec",
    "files",
    "PackageLoader",
    "__import__",
    "resource_filename",
}


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def bare_import_lines(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and _callee(node) in LOADERS:
            # a package named by a string: import_module("reports"), files("reports"),
            # jinja2.PackageLoader("reports", ...), find_spec("parity.x")
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names = [first.value]
        if any(name.split(".")[0] in BARE and " " not in name for name in names):
            lines.append(node.lineno)
    return lines


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports (an edge per statement, anywhere in the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        # the longest project module that ``name`` names or lies in
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                add(target if target in known else base)
    return found


def graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if group(module) != "megatron_npu":
        return None
    return parts[1] if len(parts) > 1 else None


def violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every (importer, imported) edge that breaks rule 2 or 3 of the module docstring."""
    bad = set()
    for src, targets in edges.items():
        top = group(src)
        exempt = _layer(src) in COMMANDS
        for dst in targets:
            if group(dst) in FORBIDDEN_TOP.get(top, ()) and not exempt:
                bad.add((src, dst))
            if _layer(src) in FOUNDATION and _layer(dst) in SUBSYSTEMS:
                bad.add((src, dst))
            if _layer(src) == "devices" and _layer(dst) == "registry":
                bad.add((src, dst))
    return bad


def test_the_graph_covers_the_four_packages():
    edges = graph()
    assert {group(name) for name in edges} == set(PACKAGES)
    # the reader sees real edges, relative and lazy ones included
    assert "megatron_npu.registry" in edges["megatron_npu.parity.matrix"]
    assert "megatron_npu.parity.mutations" in edges["megatron_npu.parity.harness"]
    assert "megatron_npu.data.errors" in edges["megatron_npu.data.index_check"]


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_nothing_imports_the_bare_folder_names():
    assert bare_imports() == []


def test_no_upward_import():
    bad = violations(graph())
    assert sorted(bad - KNOWN_UPWARD) == []
    assert sorted(KNOWN_UPWARD - bad) == [], "a known violation is gone: drop it from the list"


def test_the_checks_can_fail():
    """The cycle finder and the layer rules flag a planted circle and planted upward imports."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    planted = {
        "megatron_npu.data.x": {"megatron_npu.training.y"},
        "megatron_npu.ops.x": {"megatron_npu.parity.case"},
        "megatron_npu.parity.x": {"megatron_npu.reports.y"},
        "megatron_npu.cli": {"megatron_npu.parity.runner"},
        "megatron_npu.compare.x": {"megatron_npu.reports.y"},
        "perf.x": {"megatron_npu.reports.y"},
        "megatron_npu.registry": {"megatron_npu.patches"},
        "megatron_npu.devices.x": {"megatron_npu.registry"},
        "megatron_npu.training.y": {"megatron_npu.data.x"},
    }
    planted_source = (
        "import os\nfrom parity.case import Case\nimport reports\nfrom . import parity\n"
        'loader = PackageLoader("reports", "templates")\nprint("parity")\n'
    )
    assert bare_import_lines(planted_source) == [2, 3, 5]
    assert violations(planted) == {
        ("megatron_npu.data.x", "megatron_npu.training.y"),
        ("megatron_npu.ops.x", "megatron_npu.parity.case"),
        ("megatron_npu.parity.x", "megatron_npu.reports.y"),
        ("perf.x", "megatron_npu.reports.y"),
        ("megatron_npu.devices.x", "megatron_npu.registry"),
    }
