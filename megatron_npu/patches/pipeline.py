"""Megatron's pipeline schedules on the gloo devices (``cpu``, ``npu-emulated``).

``deallocate_output_tensor`` frees a stage's output (``out.data = torch.empty(1)``) right after
the schedule posted its send. NCCL/HCCL sends are stream-ordered, so the bytes were already
handed over; gloo's ``isend`` reads the tensor from its own thread later, and the interleaved
schedule (overlapped p2p) frees the output before it waits on the send: the freed storage can be
reused while gloo still reads it. Seen with Megatron-LM's interleaved schedule, whose
``deallocate_pipeline_outputs`` is always on: NaN losses in about half the PP2 runs, and
iteration-1 losses that differed between identical runs. On gloo the output is still replaced by
Megatron's placeholder (its backward checks that), but the sent data stays referenced until the
schedule returns, by which point it has waited on every send. On ``npu`` Megatron's own function
stays. ``megatron-npu train`` builds its config with the option off on gloo instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_npu.devices.facts import CPU, NPU_EMULATED
from megatron_npu.registry import Patch

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_GLOO = frozenset({CPU, NPU_EMULATED})
#: sent outputs' data, kept alive until the schedule that sent them returns
_in_flight: list[torch.Tensor] = []


def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
    """Megatron's placeholder swap, with the sent data kept referenced (gloo may be reading it).

    A stage's output is a tensor, or (megatron-core 0.17+) a list of them or a dict of them
    (multi-module pipelines): each tensor in it is swapped, as Megatron's own function does."""
    if out is None or not deallocate_pipeline_outputs:
        return
    if isinstance(out, dict):
        for value in out.values():
            deallocate_output_tensor(value, deallocate_pipeline_outputs)
        return
    if isinstance(out, list):
        for item in out:
            deallocate_output_tensor(item, deallocate_pipeline_outputs)
        return
    assert isinstance(out, torch.Tensor), f"expected Tensor, found {type(out).__name__}."
    assert out._base is None, "counter-productive to free a view of another tensor."
    _in_flight.append(out.data)
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _releasing_sent_outputs(schedule: Any) -> Any:
    @functools.wraps(schedule)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return schedule(*args, **kwargs)
        finally:  # every send of this schedule has been waited on
            _in_flight.clear()

    return run


_EXEMPT = (
    "tests/patches/test_pipeline_outputs.py::test_sent_output_data_lives_until_the_schedule_returns"
)

PATCHES = [
    Patch(
        id="pipeline.keep-sent-outputs-on-gloo",
        target=f"{_SCHEDULES}.deallocate_output_tensor",
        replacement=deallocate_output_tensor,
        reason="gloo's isend reads a sent stage output after the schedule freed it (interleaved "
        "schedule: NaN losses): the sent data stays referenced until the schedule returns",
        devices=_GLOO,
        parity_exempt="memory bookkeeping: keeps a tensor's storage alive, computes nothing",
        exempt_test=_EXEMPT,
        benchmark_exempt="one list append per sent micro-batch output",
    ),
    *(
        Patch(
            id=f"pipeline.release-sent-outputs.{name.removeprefix('forward_backward_')}",
            target=f"{_SCHEDULES}.{name}",
            replacement=_releasing_sent_outputs,
            kind="wrap",
            reason="the kept sent outputs are released when the schedule returns",
            devices=_GLOO,
            parity_exempt="memory bookkeeping around Megatron's own schedule",
            exempt_test=_EXEMPT,
            benchmark_exempt="one list clear per training step",
        )
        for name in (
            "forward_backward_pipelining_with_interleaving",
            "forward_backward_pipelining_without_interleaving",
        )
    ),
]
