"""One rank's session, the same for ``train``, ``evaluate`` and ``locate``'s replays.

:func:`rank_session` applies the adaptor for ``--device`` (less the patches a caller disables),
checks that the options asking for the fused attention kernel have an applied patch to serve
them, records the fused-attention choice the attention patches read (``--use-flash-attn``,
``--shape-order``, the window), starts the process group, and on the way out shuts the group down
(without the closing barrier when the rank leaves by an exception: the other ranks may never
reach it) and restores what the adaptor replaced. Errors keep their types; each command says them
in its own words (:mod:`.errors` for ``train``).
"""

from __future__ import annotations

import contextlib
from argparse import Namespace
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_npu import patcher
from megatron_npu.devices.base import Device
from megatron_npu.training import arguments


def check_fused_attention_applied(args: Namespace, device_name: str) -> None:
    """An ``attention.*`` patch exists (checked at parse time) -- it must also be applied here."""
    wants = arguments.fused_attention_requests(args)
    if not wants:
        return
    states = {r.id: r.status for r in patcher.results() if r.id.startswith("attention.")}
    if not any(status == patcher.APPLIED for status in states.values()):
        detail = ", ".join(f"{pid}: {status}" for pid, status in states.items()) or "none"
        raise arguments.ArgumentError(
            f"{', '.join(wants)} needs the fused attention patch (attention.*), which is not "
            f"applied on device {device_name} ({detail})"
        )


@contextlib.contextmanager
def rank_session(
    args: Namespace, env: Any, *, disable: Sequence[str] = (), check_attention: bool = True
) -> Iterator[Device]:
    """The active device, inside an applied adaptor and a started process group (module doc).
    ``check_attention=False``: a replay that switched the attention patch off on purpose runs
    Megatron's unfused attention instead of stopping."""
    import megatron_npu
    from megatron_npu import devices
    from megatron_npu.ops.settings import set_fused_attention
    from megatron_npu.training import launch

    megatron_npu.apply(args.device, disable=tuple(disable))
    try:
        device = devices.require_active()
        if check_attention:
            check_fused_attention_applied(args, device.name)
        set_fused_attention(
            use_flash_attn=args.use_flash_attn,
            shape_order=args.shape_order,
            pre_tokens=args.pre_tokens,
            next_tokens=args.next_tokens,
        )
        launch.init_process_group(env, device, args.distributed_timeout_minutes)
        try:
            yield device
        except BaseException:
            launch.shutdown(barrier=False)  # the other ranks may never reach a barrier
            raise
        launch.shutdown()
    finally:
        megatron_npu.restore()
