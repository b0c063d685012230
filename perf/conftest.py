"""Options of the benchmark suite: ``--perf-quick`` runs every cell at its smoke size."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--perf-quick",
        action="store_true",
        help="run every generated benchmark at its small 'quick' shape (a smoke run, minutes)",
    )


@pytest.fixture(scope="session")
def perf_size(request: pytest.FixtureRequest) -> str:
    return "quick" if request.config.getoption("--perf-quick") else "full"
