"""Planted bugs for the compare tests, active only in processes started with
``MEGATRON_NPU_TEST_PLANT`` set and this folder first on ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up, so every rank of a ``megatron-npu train`` run gets the bug):

* ``slow-attention``: the adaptor's native fused attention
  (``megatron_npu.ops.attention.native_fused_attention``, what ``--use-flash-attn`` runs on cpu)
  sleeps 100 ms per call -- a slowdown with right results;
* ``wrong-adamw``: the emulated NPU kernel ``npu_apply_adam_w`` steps with 1.5x the learning
  rate -- an accuracy bug on the NPU code path only;
* ``rms-norm-2pct``: the emulated NPU kernel ``npu_rms_norm`` returns its output 2 % too large --
  a fused-kernel bug that a row-by-row threshold lets through;
* ``overflow-at-step-N``: ``megatron-npu train`` puts ``inf`` into the first gradient element of
  every grad buffer on every rank after step ``N``'s backward, before ``optimizer.step()`` -- an
  fp16 overflow, which the dynamic loss scaler must skip.
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
elif _PLANT.startswith("overflow-at-step-"):
    from megatron_npu.training import loop as _loop

    _overflow_step = int(_PLANT.rpartition("-")[2])
    _original_train_step = _loop.train_step

    def _overflowing_train_step(
        args, step, forward_backward, data_iterators, model, optimizer, *rest
    ):
        if step != _overflow_step:
            return _original_train_step(
                args, step, forward_backward, data_iterators, model, optimizer, *rest
            )
        original_step = optimizer.step

        def step_after_overflow(*args, **kwargs):
            for chunk in model:
                buffers = [
                    *getattr(chunk, "buffers", []),
                    *getattr(chunk, "expert_parallel_buffers", []),
                ]
                for buffer in buffers:
                    buffer.grad_data.view(-1)[0] = float("inf")
            return original_step(*args, **kwargs)

        optimizer.step = step_after_overflow
        try:
            return _original_train_step(
                args, step, forward_backward, data_iterators, model, optimizer, *rest
            )
        finally:
            del optimizer.step

    _loop.train_step = _overflowing_train_step
elif _PLANT:
    raise RuntimeError(f"unknown MEGATRON_NPU_TEST_PLANT {_PLANT!r}")
