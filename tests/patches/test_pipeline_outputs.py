"""A pipeline stage's sent output keeps its storage alive on the gloo devices until the
schedule returns (gloo's isend may still be reading it when Megatron's schedule frees it)."""

from __future__ import annotations

import pytest
import torch

import megatron_npu
from megatron_npu.patches import pipeline


def _output() -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3).clone()  # not a view: Megatron asserts that


@pytest.mark.parametrize("device", ["cpu", "npu-emulated"])
def test_sent_output_data_lives_until_the_schedule_returns(device):
    from megatron.core.pipeline_parallel import schedules

    seen = {}

    def schedule(out):  # what Megatron's schedules do after posting a send
        storage = out.untyped_storage().data_ptr()
        schedules.deallocate_output_tensor(out, True)
        seen["placeholder"] = out.numel()  # Megatron's custom backward checks numel == 1
        seen["kept"] = any(t.untyped_storage().data_ptr() == storage for t in pipeline._in_flight)

    megatron_npu.apply(device)
    try:
        for name in (
            "forward_backward_pipelining_with_interleaving",
            "forward_backward_pipelining_without_interleaving",
        ):
            installed = getattr(schedules, name)
            assert installed.__wrapped__ is not installed  # the releasing wrapper is in place
        pipeline._releasing_sent_outputs(schedule)(_output())
    finally:
        megatron_npu.restore()
    assert seen == {"placeholder": 1, "kept": True}
    assert pipeline._in_flight == []  # released when the schedule returned


def test_megatron_frees_it_without_the_adaptor():
    """The premise: Megatron's own function swaps in a one-element placeholder and keeps no
    reference to the sent data."""
    from megatron.core.pipeline_parallel import schedules

    out = _output()
    schedules.deallocate_output_tensor(out, True)
    assert out.shape == (1,)
    assert pipeline._in_flight == []


def test_list_and_dict_outputs_swap_every_tensor_and_keep_each_sent_one():
    """megatron-core 0.17+ hands the function a stage's outputs as a list (and a dict for
    multi-module pipelines): every tensor in them is swapped and its data kept (a tox run on
    0.17.1 failed Megatron-LM's PP2 runs on the tensor-only version)."""
    outs = [_output(), {"a": _output(), "b": [_output()]}]
    storages = {t.untyped_storage().data_ptr() for t in (outs[0], outs[1]["a"], outs[1]["b"][0])}
    try:
        pipeline.deallocate_output_tensor(outs, True)
        assert [t.numel() for t in (outs[0], outs[1]["a"], outs[1]["b"][0])] == [1, 1, 1]
        assert {t.untyped_storage().data_ptr() for t in pipeline._in_flight} == storages
    finally:
        pipeline._in_flight.clear()
