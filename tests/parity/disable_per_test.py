"""A pytest plugin (``-p disable_per_test``) for the coverage gate's batched runs: while each test
runs (setup, call and teardown), ``$MEGATRON_NPU_DISABLE`` names the patches given for it, so one
process runs several exemption tests, each with only its own patches switched off.

The adaptor reads that variable each time it is applied, and the tests an exemption names apply
it per test (``cpu_adaptor``), so a test sees exactly its own set. ``$DISABLE_PER_TEST`` holds
the JSON file that maps a node id (``path::function``, or one parametrised case of it) to the
comma-separated patch ids; a test matched by none runs with nothing disabled."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator

import pytest

from megatron_npu.patcher import DISABLE_ENV

#: the variable naming the JSON file of node id -> disabled patch ids
PLAN_ENV = "DISABLE_PER_TEST"


@functools.cache
def _plan() -> dict[str, str]:
    with open(os.environ[PLAN_ENV]) as f:
        return json.load(f)


def _disabled_for(nodeid: str, plan: dict[str, str]) -> str:
    for node, ids in plan.items():
        if nodeid == node or nodeid.startswith(node + "["):
            return ids
    return ""


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> Iterator[None]:
    os.environ[DISABLE_ENV] = _disabled_for(item.nodeid, _plan())
    try:
        yield
    finally:
        os.environ.pop(DISABLE_ENV, None)
