"""Hygiene rules of the source tree, each with the violations it tolerates listed explicitly (the
lists are empty; an entry that is gone fails the test, so they can only shrink):

* every ``*.md`` file a source file, doc or config cites exists in the repository;
* the device names are defined once (``megatron_npu.devices.facts``): no other module of
  ``megatron_npu``, ``parity``, ``perf`` or ``reports`` spells ``"npu-emulated"`` as a string
  in code (docstrings and comments may name it), and no module outside ``megatron_npu/devices``
  holds a table keyed by device names (what is known of a device lives on the device);
* code and docs say what the code does and why, not the project's planning: no issue numbers,
  "Done when" criteria, references to the documents the project was planned from, TODO/FIXME
  markers or dated change notes;
* the commands speak one way (``megatron_npu.console``): no ``print()`` call and no write to
  ``sys.stdout``/``sys.stderr`` in ``megatron_npu``, ``parity`` or ``reports`` outside that module,
  except the machine-readable JSON ``info --json`` writes.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", ".tox", "runs", "build", "dist", "node_modules", "__pycache__"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".ini", ".txt", ".cfg"}
CITATION = re.compile(r"(?<![\w/.-])([\w./-]*\w\.md)\b")
#: the project's planning vocabulary (issue numbers, acceptance criteria, the planning documents,
#: open-work markers, dated change notes)
PLANNING = re.compile(
    r"\b[Ii]ssue #?\d+\b|\bDone[- ]when\b|\bthe seeds'|\bseed documents?\b|\bTODO\b|\bFIXME\b"
    r"|\b(?:[Rr]e-?measured|[Cc]hanged|[Ff]ixed|[Aa]dded|[Rr]emoved) on \d{4}-\d\d-\d\d\b"
)

#: (citing file, cited name) of citations allowed to point at no file
KNOWN_MISSING: set[tuple[str, str]] = set()

#: modules allowed to spell "npu-emulated" themselves instead of using the device constant
KNOWN_SPELLINGS: set[str] = set()


def _text_files():
    """(path relative to the root, path) of the repository's text files; virtual environments,
    run outputs and build folders are not entered."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in TEXT_SUFFIXES:
                yield path.relative_to(ROOT), path


def missing_citations() -> set[tuple[str, str]]:
    markdown = {rel.as_posix() for rel, _ in _text_files() if rel.suffix == ".md"}
    names = {Path(m).name for m in markdown}
    missing = set()
    for rel, path in _text_files():
        if rel == Path(__file__).resolve().relative_to(ROOT):
            continue  # this file names the missing ones on purpose
        for cited in CITATION.findall(path.read_text(encoding="utf-8", errors="replace")):
            local = (rel.parent / cited).as_posix()
            if cited in markdown or local in markdown or Path(cited).name in names:
                continue
            missing.add((rel.as_posix(), cited))
    return missing


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def spellings(name: str = "npu-emulated") -> set[str]:
    """Modules (besides the registry) with a string constant equal to ``name`` outside their
    docstrings."""
    found = set()
    for package in ("megatron_npu", "parity", "perf", "reports"):  # checkout folders
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "megatron_npu/devices/facts.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in skip
                    and node.value == name
                ):
                    found.add(rel)
    return found


def test_cited_markdown_files_exist():
    missing = missing_citations()
    assert sorted(missing - KNOWN_MISSING) == []
    assert sorted(KNOWN_MISSING - missing) == [], "a known citation is fixed: drop it here"


def test_device_names_are_spelled_once():
    found = spellings()
    assert sorted(found - KNOWN_SPELLINGS) == []
    assert sorted(KNOWN_SPELLINGS - found) == [], "a known spelling is gone: drop it here"


def nvtx_stubs() -> set[str]:
    """Modules defining a class that stands in for ``torch.cuda.nvtx``."""
    found = set()
    for package in ("megatron_npu", "parity", "perf", "reports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if any(
                isinstance(n, ast.ClassDef) and "nvtx" in n.name.lower() for n in ast.walk(tree)
            ):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def planning_words() -> set[tuple[str, int, str]]:
    """(file, line, words) of every planning word in the repository's text files."""
    found = set()
    this = Path(__file__).resolve().relative_to(ROOT)
    for rel, path in _text_files():
        if rel == this:
            continue  # this file spells the vocabulary out
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            for match in PLANNING.finditer(line):
                found.add((rel.as_posix(), number, match.group(0)))
    return found


def test_code_and_docs_carry_no_planning_words():
    assert sorted(planning_words()) == []


DEVICE_NAMES = {"cpu", "npu", "npu-emulated", "cuda"}
DEVICE_CONSTANTS = {"CPU", "NPU", "NPU_EMULATED", "CUDA"}


def _device_key(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in DEVICE_NAMES
    return isinstance(node, ast.Name) and node.id in DEVICE_CONSTANTS


def device_keyed_tables(source: str, rel: str) -> list[tuple[str, int]]:
    """(file, line) of each dict literal in ``source`` with two or more device names as keys."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict) and sum(map(_device_key, node.keys)) >= 2:
            found.append((rel, node.lineno))
    return found


def device_tables_outside_devices() -> list[tuple[str, int]]:
    found = []
    for package in ("megatron_npu", "parity", "perf", "reports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith("megatron_npu/devices/"):
                found += device_keyed_tables(path.read_text(encoding="utf-8"), rel)
    return found


def test_no_device_keyed_table_outside_the_devices():
    assert device_tables_outside_devices() == []


def test_the_nvtx_stub_is_defined_once():
    assert nvtx_stubs() == {"megatron_npu/devices/base.py"}


#: (file, line text) of the writes allowed to bypass the console: data, not lines
CONSOLE_EXEMPT = {("megatron_npu/info.py", "sys.stdout.write('\\n')")}


def console_bypasses(source: str, rel: str) -> list[tuple[str, str]]:
    """(file, call) of each ``print(...)`` and ``sys.stdout``/``sys.stderr`` ``.write(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        called = ast.unparse(node.func)
        if called == "print" or called in ("sys.stdout.write", "sys.stderr.write"):
            found.append((rel, ast.unparse(node)))
    return found


def console_bypasses_in_tree() -> list[tuple[str, str]]:
    found = []
    for package in ("megatron_npu", "parity", "reports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "megatron_npu/console.py":
                found += console_bypasses(path.read_text(encoding="utf-8"), rel)
    return [hit for hit in found if hit not in CONSOLE_EXEMPT]


def test_the_commands_speak_through_the_console():
    assert console_bypasses_in_tree() == []


def test_the_scans_see_a_violation():
    """The regular expression and the AST scan find what they are for."""
    assert CITATION.findall("see REFERENCE.md section 3 and `docs/parity-results.md`.") == [
        "REFERENCE.md",
        "docs/parity-results.md",
    ]
    planned = "see issue 12; Done-when of the seeds' plan; TODO; re-measured on 2026-11-23"
    assert [m.group(0) for m in PLANNING.finditer(planned)] == [
        "issue 12",
        "Done-when",
        "the seeds'",
        "TODO",
        "re-measured on 2026-11-23",
    ]
    assert not PLANNING.findall("a tissue 3 todo list, the seeds of the RNG, issued 4 times")
    table = 'SIZES = {"cpu": 1, CUDA: 2}\nNAMES = {"cpu": 1, "x": 2}\n'
    assert device_keyed_tables(table, "m.py") == [("m.py", 1)]
    spoken = 'print("a", file=sys.stderr)\nsys.stderr.write("b")\nconsole.say("c")\n'
    assert console_bypasses(spoken, "m.py") == [
        ("m.py", "print('a', file=sys.stderr)"),
        ("m.py", "sys.stderr.write('b')"),
    ]
    tree = ast.parse('"""npu-emulated in a docstring"""\nDEVICE = "npu-emulated"\n')
    constants = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    assert len(constants) - len(_docstrings(tree)) == 1
