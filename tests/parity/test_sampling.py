"""A case's drawn examples do not depend on what the drawing process imported before.

Hypothesis sometimes draws literals from the local modules loaded at the time; the report
package alone (imported when a session also collects ``tests/reports``) changed a seed in
``te-dot-product-attention``'s quick examples, and with it that bf16 cell's verdict. The draws
are made in two fresh interpreters, one of which imports every report module first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_DRAW = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from megatron_npu.parity.matrix import case_examples, patches_with_cases
print(json.dumps({c.name: case_examples(c.name, "quick") for _, c in patches_with_cases()},
                 sort_keys=True, default=repr))
"""


def _draws(*imports: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _DRAW, *imports],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_examples_are_the_same_whatever_was_imported_before():
    plain = _draws()
    after_reports = _draws("megatron_npu.reports", "megatron_npu.compare", "megatron_npu.locate")
    assert plain.keys() == after_reports.keys()
    differ = sorted(name for name in plain if plain[name] != after_reports[name])
    assert not differ, f"examples drawn differently after more imports: {differ}"
