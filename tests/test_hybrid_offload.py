"""megatron-core's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) with the adaptor's
split of parameters between host and accelerator (:mod:`megatron_npu.optim.hybrid_offload`).

megatron-core tells an accelerator parameter by ``is_cuda``; on the NPU and the host-only
devices nothing was offloaded and the step raised ``KeyError``. Here the offloaded share, the
maps between parameters and their copies, and one step of each half against torch's AdamW on
fp32 copies are checked on the CPU adaptor.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.optimizer.cpu_offloading")

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer  # noqa: E402

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    sizes = (100, 60, 40, 100)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16)) for n in sizes]


def _hybrid(params, fraction: float, overlap: bool = False) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(
        params,
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        **HYPER,
    )


@pytest.mark.parametrize(
    ("fraction", "offloaded"), [(0.0, 0), (0.3, 1), (0.5, 2), (0.6, 3), (1.0, 4)]
)
def test_the_first_parameters_up_to_the_fraction_go_to_the_host(cpu_adaptor, fraction, offloaded):
    params = _params()
    opt = _hybrid(params, fraction)
    host = [p for group in opt.cpu_param_groups for p in group["params"]]
    device = [p for group in opt.gpu_param_groups for p in group["params"]]
    assert len(host) == offloaded and len(device) == len(params) - offloaded
    for param, copy in zip(params[:offloaded], host, strict=True):
        assert opt.gpu_params_map_cpu_copy[param] is copy
        assert opt.cpu_copys_map_gpu_param[copy] is param
        assert copy.dtype == torch.float32 and copy.data_ptr() != param.data_ptr()
    for param, copy in zip(params[offloaded:], device, strict=True):
        assert param not in opt.gpu_params_map_cpu_copy
        assert opt.param_to_fp32_param[param] is copy and copy.dtype == torch.float32


@pytest.mark.parametrize("overlap", [False, True], ids=["one-host-optimizer", "overlapped"])
def test_a_step_is_adamw_on_fp32_copies_for_both_halves(cpu_adaptor, overlap):
    """Both halves step as torch's AdamW on fp32 copies, bitwise; ``overlap`` is
    ``--overlap-cpu-optimizer-d2h-h2d`` (one host optimizer per parameter, copies on the
    device's streams)."""
    params = _params()
    opt = _hybrid(params, 0.5, overlap)
    reference = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = torch.optim.AdamW(reference, **HYPER)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        for param, ref in zip(params, reference, strict=True):
            grad = torch.randn(param.shape, generator=g)
            param.grad = grad.to(param.dtype)
            ref.grad = param.grad.float()
        opt.step()
        ref_opt.step()
        for param, ref in zip(params, reference, strict=True):
            assert torch.equal(param.detach(), ref.detach().to(param.dtype)), step
    steps = [s["step"] for o in opt.cpu_optimizers for s in o.state.values()]
    assert len(steps) == 2 and all(s == 3 for s in steps)
