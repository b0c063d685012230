"""Planted bugs for the compare tests, active only in processes started with
``MEGATRON_NPU_TEST_PLANT`` set and this folder first on ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up, so every rank of a ``megatron-npu train`` run gets the bug):

* ``slow-attention``: the adaptor's native fused attention
  (``megatron_npu.ops.attention.native_fused_attention``, what ``--use-flash-attn`` runs on cpu)
  sleeps 100 ms per call -- a slowdown with right results;
* ``wrong-adamw``: the emulated NPU kernel ``npu_apply_adam_w`` steps with 1.5x the learning
  rate -- an accuracy bug on the NPU code path only;
* ``rms-norm-2pct``: the emulated NPU kernel ``npu_rms_norm`` returns its output 2 % too large --
  a fused-kernel bug that a row-by-row threshold lets through.
"""

import os

_PLANT = os.environ.get("MEGATRON_NPU_TEST_PLANT")

if _PLANT == "slow-attention":
    import time

    from megatron_npu.ops import attention as _attention

    _original_attention = _attention.native_fused_attention

    def _slow_attention(*args, **kwargs):
        time.sleep(0.1)
        return _original_attention(*args, **kwargs)

    _attention.native_fused_attention = _slow_attention
elif _PLANT == "wrong-adamw":
    from megatron_npu.testing import torch_npu_emulation as _emulation

    _original_adamw = _emulation.npu_apply_adam_w

    def _wrong_adamw(beta1_power, beta2_power, lr, *args, **kwargs):
        return _original_adamw(beta1_power, beta2_power, lr * 1.5, *args, **kwargs)

    _emulation.npu_apply_adam_w = _wrong_adamw
elif _PLANT == "rms-norm-2pct":
    from megatron_npu.testing import torch_npu_emulation as _emulation

    _original_rms_norm = _emulation.npu_rms_norm

    def _wrong_rms_norm(*args, **kwargs):
        out, rstd = _original_rms_norm(*args, **kwargs)
        return out * 1.02, rstd

    _emulation.npu_rms_norm = _wrong_rms_norm
elif _PLANT:
    raise RuntimeError(f"unknown MEGATRON_NPU_TEST_PLANT {_PLANT!r}")
