"""Peak memory of one call, from torch's own allocation events.

``tracemalloc`` does not see torch's allocator, and the process RSS mixes in everything else the
interpreter holds. :func:`peak_allocated_bytes` runs the call once under ``torch.profiler`` with
``profile_memory=True`` and replays the allocation/free events in time order: the figure is the
highest total of bytes torch allocated *during* the call above what was live before it (inputs
and state that already exist are not counted; outputs, temporaries and saved activations are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Highest extra bytes allocated by torch (CPU) while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return int(peak)
