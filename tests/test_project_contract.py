"""The README's two commands are the project's contract with users and CI."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_readme_holds_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert all("-c constraints.txt" in c for c in commands), "torch must stay pinned"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci
    assert "|| true" not in ci and "set -euo pipefail" in ci


def test_constraints_pin_the_cpu_torch_wheel():
    pins = (ROOT / "constraints.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", pins, flags=re.M)
