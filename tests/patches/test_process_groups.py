"""``process-groups.nccl-options``: a process group named in Megatron's NCCL communicator options
(``--nccl-communicator-config-path``, ``--high-priority-stream-groups``; Megatron-LM adds ``dp_cp``
to the latter for ``--use-torch-fsdp2``) is built with ``ProcessGroupNCCL.Options``, which a torch
without NCCL lacks. Off CUDA the group takes its backend's defaults, with one line naming it."""

from __future__ import annotations

import megatron_npu
from megatron_npu.patches import process_groups
from megatron_npu.registry import get_patch


def test_nccl_options_give_the_backend_defaults_with_one_line(capsys):
    from megatron.core import parallel_state

    process_groups._say_not_applied.cache_clear()
    megatron_npu.apply("cpu", patches=[get_patch("process-groups.nccl-options")])
    try:
        configs = {"dp_cp": {"is_high_priority_stream": True, "max_ctas": 8}}
        assert parallel_state.get_nccl_options("dp_cp", configs) is None
        assert parallel_state.get_nccl_options("dp_cp", configs) is None
        assert parallel_state.get_nccl_options("tp", configs) is None
    finally:
        megatron_npu.restore()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "megatron-npu: NCCL communicator options for process group 'dp_cp' "
        "(is_high_priority_stream, max_ctas) do not apply to cpu's process groups; the group "
        "takes its backend's defaults"
    ]
