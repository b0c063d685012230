"""Which parameters megatron-core's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``)
steps on the host, on any device.

megatron-core tells a parameter on the accelerator by ``param.is_cuda``, which is False for an
NPU tensor and for every tensor of the host-only stand-ins (``cpu``, ``npu-emulated``), so it
offloaded nothing and then looked every parameter up among its host copies (``KeyError``).
Here a parameter is on the accelerator when it is on the active device's torch device type (on
a host-only device: every parameter, which is where the model lives there). The split is
megatron-core's: in the order of the parameter groups, parameters are copied to the host until
``offload_fraction`` of the accelerator's elements are there; those copies (in fp32 when
``param_update_in_fp32``) are stepped by the host optimizer, the rest by the accelerator's, an
fp32 copy of a 16-bit parameter standing in for it. Host copies are page-locked only where an
accelerator exists to copy to.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_npu import devices
from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE


def _host_copy(param: torch.Tensor) -> torch.Tensor:
    """``param`` copied to page-locked host memory, through the routed ``torch.empty`` (which
    keeps ``pin_memory`` only where an accelerator exists)."""
    copy = TORCH_NAMESPACE.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
    return copy.copy_(param.detach())


def sub_optimizer_param_groups(self: Any, offload_fraction: float) -> tuple:
    """``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` with the accelerator told by
    device type: (host groups, accelerator groups, param -> host copy, host copy -> param,
    param -> fp32 copy)."""
    accelerator = devices.active().torch_type
    params = [p for group in self.param_groups for p in group["params"]]
    threshold = offload_fraction * sum(p.numel() for p in params if p.device.type == accelerator)
    offloaded = 0
    host_groups, device_groups = [], []
    to_host, from_host, to_fp32 = {}, {}, {}
    for group in self.param_groups:
        host = {**group, "params": []}
        device = {**group, "params": []}
        for param in group["params"]:
            inner, copied = param, False
            on_accelerator = param.device.type == accelerator
            if offloaded < threshold and on_accelerator:
                inner = _host_copy(param)
                offloaded += inner.numel()
                copied = True
            if self.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                to_fp32[param] = inner
            if copied:
                to_host[param] = inner
                from_host[inner] = param
                host["params"].append(inner)
            elif on_accelerator:
                device["params"].append(inner)
            else:
                host["params"].append(inner)
        if device["params"]:
            device_groups.append(device)
        if host["params"]:
            host_groups.append(host)
    return host_groups, device_groups, to_host, from_host, to_fp32
