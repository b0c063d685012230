"""Parametrisations split across the suite's tiers (``tests/conftest.py``): the cases named as
extended run only with ``--extended`` (``tox -e extended``)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def with_extended(values: Iterable, extended: Iterable) -> list:
    """``values`` as parametrize arguments, those in ``extended`` marked ``extended``."""
    extended = set(extended)
    return [pytest.param(v, marks=pytest.mark.extended) if v in extended else v for v in values]
