"""The suite's own options and fixtures.

Two tiers of tests the default suite (the README's test command) leaves out, each behind its
option, so that suite stays within its time on two cores:

``--per-release``: the tests marked ``per_release`` repeat whole training runs of other tests
(an exemption's test run again with its patch switched off); tox runs them once per
megatron-core release.

``--extended``: the tests marked ``extended`` are end-to-end runs that reach, at another layout,
precision or planted bug, branches a default test reaches already (the rest of the locate sweep,
Megatron-LM's run list, the context-parallel layouts); ``tox -e extended`` runs them.

Session inputs computed once per pytest invocation, also under ``pytest -n N``.

Every xdist worker has a session of its own, so a session fixture that trains a model or runs a
comparison would run once per worker. ``once_per_run.built_once`` builds such an input in the
directory all workers of one invocation share (:func:`xdist_shared`), behind a file lock; the
other workers wait for it and read it back. Inputs built this way are read-only to the tests (a test
that changes one works on its own copy).

Under ``pytest -n N`` the workers share the host's cores: each worker, and every process its tests
start, gets ``cores // N`` OpenMP threads unless ``OMP_NUM_THREADS`` is set. Two workers of two
threads each on two cores spin in each other's OpenMP barriers; one thread each ran ``tests/ops``
in 101 s instead of 125 s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // int(workerinput["workercount"]))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


#: marker -> the option that runs the tests it marks (the default suite leaves them out)
OPTIONAL_TIERS = {"per_release": "--per-release", "extended": "--extended"}


def pytest_addoption(parser):
    parser.addoption(
        "--per-release",
        action="store_true",
        help="also run the tests marked per_release (tox runs them once per megatron-core "
        "release; the default suite leaves them out to stay within its time)",
    )
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the tests marked extended (tox -e extended; the default suite leaves "
        "them out to stay within its time)",
    )


def pytest_collection_modifyitems(config, items):
    """Leave out (deselect, and say so) the tests of each tier whose option is not given."""
    left_out = [m for m, option in OPTIONAL_TIERS.items() if not config.getoption(option)]
    kept = [i for i in items if not any(i.get_closest_marker(m) for m in left_out)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def xdist_shared(tmp_path_factory, request) -> Path:
    """A directory every xdist worker of this pytest invocation sees (the session's own
    otherwise)."""
    base = tmp_path_factory.getbasetemp()
    under_xdist = hasattr(request.config, "workerinput")
    root = (base.parent if under_xdist else base) / "shared"
    root.mkdir(exist_ok=True)
    return root
