"""pytest plugin of the parity matrix: its options and session fixtures.

Loaded by the project's ``conftest.py`` and by ``megatron-npu parity``
(``-p megatron_npu.parity.plugin``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "megatron-npu parity matrix")
    group.addoption(
        "--parity-mode",
        default="quick",
        choices=("quick", "full"),
        help="examples per cell: quick (CI) or full",
    )
    group.addoption(
        "--parity-devices",
        default="cpu,npu-emulated",
        help="comma-separated devices for the parity matrix (cpu, npu-emulated, npu, cuda)",
    )
    group.addoption(
        "--parity-results",
        default=os.path.join("results", "parity"),
        help="directory the parity records are written to",
    )


@pytest.fixture(scope="session")
def parity_mode(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("parity_mode")


@pytest.fixture(scope="session")
def parity_results(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("parity_results")


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[object]:
    """Multi-rank process groups for parity cases, closed when the session ends."""
    from megatron_npu.parity.ranks import PoolManager

    manager = PoolManager()
    yield manager
    manager.close()
