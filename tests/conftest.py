"""Session inputs computed once per pytest invocation, also under ``pytest -n N``.

Every xdist worker has a session of its own, so a session fixture that trains a model or runs a
comparison would run once per worker. ``once_per_run.built_once`` builds such an input in the
directory all workers of one invocation share (:func:`xdist_shared`), behind a file lock; the
other workers wait for it and read it back. Inputs built this way are read-only to the tests (a test
that changes one works on its own copy).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def xdist_shared(tmp_path_factory, request) -> Path:
    """A directory every xdist worker of this pytest invocation sees (the session's own
    otherwise)."""
    base = tmp_path_factory.getbasetemp()
    under_xdist = hasattr(request.config, "workerinput")
    root = (base.parent if under_xdist else base) / "shared"
    root.mkdir(exist_ok=True)
    return root
