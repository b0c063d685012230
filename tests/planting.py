"""The one way the tests plant a bug in a run they start: ``tests/compare/plants/sitecustomize.py``
(its docstring lists the plants), imported at start-up by every process whose environment
:func:`plant_env` made."""

from __future__ import annotations

import os
from pathlib import Path

PLANTS = Path(__file__).resolve().parent / "compare" / "plants"
VARIABLE = "MEGATRON_NPU_TEST_PLANT"


def plant_env(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that plant ``name`` in a process started with them (``base``'s
    ``PYTHONPATH``, default this process's, kept after the plants folder)."""
    path = (os.environ if base is None else base).get("PYTHONPATH")
    return {VARIABLE: name, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLANTS), path]))}
