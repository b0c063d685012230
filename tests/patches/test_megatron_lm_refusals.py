"""What the adaptor refuses of Megatron-LM's options: one line per option, starting with the
option, and where the line tells the user to shard or train another way, that way is an option
of the Megatron-LM release paired with the installed megatron-core and the adaptor serves it
(neither refused by name nor by Megatron's own FSDP2 failures)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megatron_npu.patches import megatron_lm, torch_fsdp2
from tests.megatron_lm._client import megatron_lm_folder

#: a value of each trigger kind that asks for the refused feature
_ASKING = {"not-none": "local", "above-1": 2, "set": "x", "fp8-dtype": "fp8"}


def _refused(**args) -> list[str]:
    namespace = SimpleNamespace(**args)
    return megatron_lm.unsupported_options(namespace) + torch_fsdp2.problems(namespace)


@pytest.mark.parametrize(
    "name, trigger, option",
    [(name, trigger, option) for name, trigger, option, _ in megatron_lm.UNSUPPORTED],
    ids=[f"{option}-{name}" for name, _, option, _ in megatron_lm.UNSUPPORTED],
)
def test_a_refused_option_is_one_line_and_the_way_it_names_is_served(name, trigger, option):
    lines = _refused(**{name: _ASKING.get(trigger, trigger)})
    assert len(lines) == 1 and lines[0].startswith(f"{option}: "), lines
    arguments = (megatron_lm_folder() / "megatron" / "training" / "arguments.py").read_text()
    for suggested in re.findall(r"\b(?:with|use) (--[a-z0-9-]+)", lines[0]):
        assert f"'{suggested}'" in arguments, (option, suggested)  # Megatron-LM has it
        assert _refused(**{suggested[2:].replace("-", "_"): True}) == [], (option, suggested)
