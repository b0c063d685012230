"""NCCL communicator options on a device whose process groups are not NCCL's.

Megatron builds each process group with ``get_nccl_options(name, cfgs)``: for a group named in
``--nccl-communicator-config-path`` or ``--high-priority-stream-groups`` (Megatron-LM adds
``dp_cp`` to it for ``--use-torch-fsdp2``) it constructs ``ProcessGroupNCCL.Options``, a class a
torch without NCCL does not have. The NPU's groups are HCCL's and cpu's and npu-emulated's are
gloo's; neither takes NCCL's CTA counts, cluster sizes or stream priorities. Those groups get their
backend's defaults, and one line per process names what was not applied.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_npu import console, devices
from megatron_npu.registry import Patch


@functools.cache
def _say_not_applied(group: str, options: tuple[str, ...]) -> None:
    console.warn(
        f"megatron-npu: NCCL communicator options for process group {group!r} "
        f"({', '.join(options)}) do not apply to {devices.require_active().name}'s "
        "process groups; the group takes its backend's defaults"
    )


def _backend_defaults_off_nccl(original: Any) -> Any:
    @functools.wraps(original)
    def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict) -> Any:
        if pg_name not in nccl_comm_cfgs:
            return original(pg_name, nccl_comm_cfgs)
        _say_not_applied(pg_name, tuple(sorted(nccl_comm_cfgs[pg_name])))
        return None

    return get_nccl_options


PATCHES = [
    Patch(
        id="process-groups.nccl-options",
        target="megatron.core.parallel_state.get_nccl_options",
        replacement=_backend_defaults_off_nccl,
        kind="wrap",
        reason="NCCL communicator options (--nccl-communicator-config-path, "
        "--high-priority-stream-groups) build ProcessGroupNCCL.Options: HCCL and gloo groups "
        "take their defaults, with one line saying so",
        versions=">=0.13",
        parity_exempt="process-group plumbing, no numerics of its own",
        benchmark_exempt="runs once per process group, at start-up",
        exempt_test="tests/patches/test_process_groups.py::"
        "test_nccl_options_give_the_backend_defaults_with_one_line",
    ),
]
