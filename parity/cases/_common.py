"""Small helpers shared by parity cases."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from megatron_npu.devices.facts import DEVICE_ORDER

#: a case that runs in fp32 only, on every device
FP32_ONLY = {device: (torch.float32,) for device in DEVICE_ORDER}


def generator(params: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(params.get("seed", 0)))


def megatron_config(**overrides: Any) -> Any:
    """A minimal TransformerConfig for building one Megatron module."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    base.update(overrides)
    return TransformerConfig(**base)


def build_from_spec(spec: Any, config: Any) -> Any:
    """A Megatron submodule from its spec: a ``ModuleSpec`` through ``build_module``, or a
    builder (megatron-core 0.18+ specs the MoE layer as a ``functools.partial``) called."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    return (
        build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    )


def grads(out: torch.Tensor, grad_out: torch.Tensor, **leaves: torch.Tensor | None) -> dict:
    """Back-propagate ``grad_out`` and collect ``grad_<name>`` for each non-None leaf."""
    out.backward(grad_out.to(out.dtype))
    return {f"grad_{k}": v.grad for k, v in leaves.items() if v is not None}


#: while a job keeps its one-rank world (:func:`one_rank_world_kept`): the teardowns of what
#: :func:`megatron_parallel` set up, run when the job ends
_kept: contextlib.ExitStack | None = None


@contextlib.contextmanager
def one_rank_world_kept() -> Iterator[None]:
    """Within the block, what :func:`megatron_parallel` sets up in a single process (the one-rank
    world and Megatron's parallel state) stays up until the block ends, rather than being torn
    down after each call: on the host backend (gloo) setting them up and tearing them down is
    most of a small case's time. The parity harness keeps them for one host-device job, whose
    implementation and reference share gloo; everything is torn down when the job ends, however
    it ends."""
    global _kept
    if _kept is not None:
        yield
        return
    with contextlib.ExitStack() as stack:
        _kept = stack
        try:
            yield
        finally:
            _kept = None


@contextlib.contextmanager
def megatron_parallel(seed: int = 1234) -> Iterator[None]:
    """Megatron's parallel_state and model-parallel RNG tracker for one call.

    In a rank-pool worker both already exist (the pool initialised them for the job's layout)
    and are used as they are. In a single-process case a one-rank world on the active device's
    backend (gloo on cpu and npu-emulated, hccl on npu) and
    ``initialize_model_parallel(1, 1)`` are set up here and torn down on exit (at the end of the
    job inside :func:`one_rank_world_kept`), so the test process is left as it was found. The
    RNG tracker is (re)seeded either way: Megatron's unfused attention forks it even with
    dropout 0.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_npu import devices

    store = None
    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix="megatron-npu-parity-")
        active = devices.active()  # the device's own backend: hccl on an NPU, gloo on the CPU
        try:
            dist.init_process_group(
                active.dist_backend if active is not None else "gloo",
                init_method=f"file://{os.path.join(store, 'store')}",
                rank=0,
                world_size=1,
            )
        except BaseException:
            shutil.rmtree(store, ignore_errors=True)
            raise
    made_state = not parallel_state.model_parallel_is_initialized()

    def teardown() -> None:
        if made_state:
            parallel_state.destroy_model_parallel()
        if store is not None:
            dist.destroy_process_group()
            shutil.rmtree(store, ignore_errors=True)

    try:
        if made_state:
            parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        if _kept is not None:
            _kept.callback(teardown)
        else:
            teardown()


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run ``torch.compile``-decorated code eagerly.

    Megatron's ``jit_fuser`` is ``torch.compile`` on torch >= 2.2; compiling its fused
    activations on the CPU takes tens of seconds per shape and dtype and changes nothing about
    their maths, so references call them under the ``force_eager`` stance.
    """
    with torch.compiler.set_stance("force_eager"):
        yield


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` and viewed as integers: compares bit-exactly (exact kind)."""
    return t.detach().to(dtype).contiguous().view(_BITS[dtype])


def gather(t: torch.Tensor, group: Any = None, dim: int | None = None) -> torch.Tensor:
    """``t`` from every rank of ``group`` (plain ``all_gather``, used only to bring results to
    rank 0): stacked on a new leading dim, or concatenated along ``dim``."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        parts = [t.detach()]
    else:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.stack(parts) if dim is None else torch.cat(parts, dim=dim)


@contextlib.contextmanager
def fused_attention_settings(**changes: Any) -> Iterator[None]:
    """:mod:`megatron_npu.ops.settings` changed for one call, put back afterwards."""
    from dataclasses import asdict

    from megatron_npu.ops import settings

    before = asdict(settings.fused_attention())
    settings.set_fused_attention(**changes)
    try:
        yield
    finally:
        settings.set_fused_attention(**before)


def key_flags(actual: list, expected: list) -> torch.Tensor:
    """One exact flag per expected item (1 where ``actual`` has it at that place), then the
    number of actual items: all ones and ``len(expected)`` when they agree (checkpoint keys,
    compared exactly by the parity rules)."""
    flags = [int(i < len(actual) and actual[i] == e) for i, e in enumerate(expected)]
    return torch.tensor([*flags, len(actual)], dtype=torch.int64)


def expected_key_flags(expected: list) -> torch.Tensor:
    """What :func:`key_flags` gives when the keys are exactly ``expected``."""
    return torch.tensor([1] * len(expected) + [len(expected)], dtype=torch.int64)
