"""Device selection, the CPU answers to torch.cuda, routing, and the torch_npu-without-CANN path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import megatron_npu
from megatron_npu import devices
from megatron_npu.devices import DeviceUnavailableError, npu


def test_env_var_overrides_detection(monkeypatch):
    monkeypatch.setenv(devices.ENV_VAR, "npu-emulated")
    assert devices.requested_name() == "npu-emulated"
    monkeypatch.setenv(devices.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=r"MEGATRON_NPU_DEVICE='tpu' is not a device"):
        devices.requested_name()


def test_explicit_name_beats_env(monkeypatch):
    monkeypatch.setenv(devices.ENV_VAR, "npu")
    assert devices.requested_name("cpu") == "cpu"


def test_detection_without_torch_npu_is_cpu(monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    monkeypatch.setattr(npu, "torch_npu_installed", lambda: False)
    assert devices.requested_name() == "cpu"


def _no_cann(monkeypatch):
    monkeypatch.setattr(npu, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(npu, "torch_npu_version", lambda: "2.13.0")

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(npu, "_load_library", missing)


def test_torch_npu_without_cann_gives_one_clear_message(monkeypatch):
    _no_cann(monkeypatch)
    with pytest.raises(DeviceUnavailableError) as err:
        devices.make("npu")
    message = str(err.value)
    assert "torch_npu 2.13.0 is installed but Ascend's CANN runtime is missing" in message
    assert "libhccl.so" in message and "libascendcl.so" in message
    assert "set_env.sh" in message and "MEGATRON_NPU_DEVICE=cpu" in message
    assert "\n" not in message


def test_auto_detection_falls_back_to_cpu_with_the_message(monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    _no_cann(monkeypatch)
    with pytest.warns(RuntimeWarning, match="CANN runtime is missing.*running on cpu instead"):
        assert devices.requested_name() == "cpu"


def test_torch_npu_not_installed_message(monkeypatch):
    monkeypatch.setattr(npu, "torch_npu_installed", lambda: False)
    with pytest.raises(DeviceUnavailableError, match=r"pip install 'megatron-npu\[npu\]'"):
        devices.make("npu")


def test_cli_reports_missing_cann_without_traceback(tmp_path):
    """A torch_npu package that is installed but cannot load CANN, as on this workplace."""
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: "
        "No such file or directory')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), devices.ENV_VAR: "npu"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "info"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "CANN runtime is missing" in proc.stderr
    assert "libhccl.so" in proc.stderr


def test_cuda_only_when_available():
    if torch.cuda.is_available():
        assert devices.make("cuda").dist_backend == "nccl"
    else:
        with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
            devices.make("cuda")


def test_cpu_accelerator_rng_round_trip():
    acc = devices.make("cpu").accelerator
    acc.manual_seed(7)
    state = acc.get_rng_state()
    a = torch.rand(5)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(5))
    acc.manual_seed(8)
    assert not torch.equal(a, torch.rand(5))


def test_cpu_accelerator_answers_megatron_queries():
    acc = devices.make("cpu").accelerator
    assert acc.current_device() == torch.device("cpu")
    assert acc.get_device_capability() == (0, 0)
    assert acc.max_memory_allocated() >= acc.memory_allocated() > 0
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    with acc.nvtx.range("x"), acc.stream(acc.Stream()):
        acc.synchronize()
    with pytest.raises(AttributeError, match=r"torch.cuda.graphs_not_a_thing"):
        acc.graphs_not_a_thing  # noqa: B018


def test_megatron_modules_see_routed_torch_only_while_applied(cpu_adaptor):
    from megatron.core import utils as mcore_utils

    routed = mcore_utils.torch
    assert routed is not torch
    assert routed.empty(3, device="cuda").device.type == "cpu"
    assert routed.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert routed.tensor([1.0], device=0).device.type == "cpu"
    assert routed.device("cuda", routed.cuda.current_device()) == torch.device("cpu")
    # Megatron-FSDP's f"cuda:{torch.cuda.current_device()}" renders the current device itself
    assert routed.device(f"cuda:{routed.cuda.current_device()}") == torch.device("cpu")
    assert routed.device("cuda:0") == routed.device("cuda") == torch.device("cpu")
    assert isinstance(torch.device("cpu"), routed.device)
    assert routed.nn is torch.nn and routed.float16 is torch.float16
    # Megatron-LM's CP batch split asks for pinned memory, which a host-only torch cannot give
    pinned = routed.tensor([0, 3], device="cpu", pin_memory=True)
    assert pinned.tolist() == [0, 3] and not pinned.is_pinned()
    megatron_npu.restore()
    assert mcore_utils.torch is torch


def test_tensor_cuda_and_scoped_type_names(cpu_adaptor):
    from megatron_npu.patches.tensor_methods import cuda_type_spelling

    t = torch.ones(2)
    assert t.cuda().device.type == "cpu"
    assert t.type() == "torch.FloatTensor", "outside Megatron's checks torch's answer stands"
    with cuda_type_spelling():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.half().type() == "torch.cuda.HalfTensor"
        assert t.type(torch.float64).dtype == torch.float64


def test_megatron_grad_clip_type_check_passes_on_cpu(cpu_adaptor):
    """clip_grad_by_total_norm_fp32 asserts grads are 'torch.cuda.FloatTensor'."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=8.0)
    assert torch.allclose(p.grad, torch.full((4,), 2.0 / (8.0 + 1e-6)))


def test_unknown_cuda_attribute_names_what_is_missing_in_a_subprocess():
    code = textwrap.dedent(
        """
        import megatron_npu
        megatron_npu.apply("cpu")
        from megatron.core.tensor_parallel import random as r
        try:
            r.torch.cuda.totally_unknown()
        except AttributeError as e:
            print("ERR", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR megatron-npu's cpu device layer has no answer for torch.cuda.totally_unknown" in (
        out.stdout
    ), out.stderr[-2000:]
