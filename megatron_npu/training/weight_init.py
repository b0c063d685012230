"""Initial weights that are the same in every layout, built on the device where Megatron allows it.

Megatron-Core has two initialisation paths, chosen by ``use_cpu_initialization``:

* **host** (``True``): ``_initialize_affine_weight_cpu`` draws each tensor-parallel weight whole
  (the *master*, fp32) on every rank and copies out the rank's slices; the model lives in host
  memory until it is moved to the device;
* **device** (``False``, Megatron's default): the parameter is allocated on the device and
  ``_initialize_affine_weight_gpu`` calls ``init_method`` on the rank's shard inside the
  model-parallel RNG fork -- each TP rank draws its own shard from its own generator, so a TP2
  model is not the TP1 model split in two, and the values depend on the device's RNG.

With ``--layout-independent-init`` (train's default is Megatron-LM's own initialisation),
:class:`LayoutIndependentInit` wraps the config's init methods so that both paths give the same
weights, and the same weights on every device: every draw comes from one CPU stream
(:data:`INIT_STREAM`, re-seeded per model chunk and per global layer by
:mod:`megatron_npu.training.model`); a tensor-parallel shard (the device path) is filled with its
slices of the master drawn whole, exactly as the host path slices it. The device path therefore
keeps one fp32 master weight in host memory at a time, never the model; the parameters are
allocated on the device from the start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state

#: the CPU generator every initial weight is drawn from (re-seeded by :func:`reseed`)
INIT_STREAM = torch.Generator()


def reseed(seed: int) -> None:
    """Start the init stream (and, for code that draws on its own, the CPU generator)
    at ``seed``."""
    INIT_STREAM.manual_seed(seed)
    torch.default_generator.manual_seed(seed)


#: while an MoE expert is built: its tensor-parallel weights are split over the expert
#: tensor-parallel group (``--expert-tensor-parallel-size``), not the dense TP group
_in_expert = False
#: while a gated (SwiGLU) FC1 is built: each TP rank holds its slice of the gate rows followed by
#: its slice of the up rows, i.e. the master cut with stride 2 (Megatron's forward halves the
#: local output, its checkpoint maps the halves back); megatron-core up to 0.15 does not mark
#: the weight's ``partition_stride`` so, from 0.16 it does
_gated_fc1 = False


@contextlib.contextmanager
def expert(seed: int | None) -> Iterator[None]:
    """Draws inside the block are an expert's: the stream starts at ``seed`` (when given) and
    tensor-parallel shards are cut by the expert tensor-parallel rank."""
    global _in_expert
    if seed is not None:
        reseed(seed)
    before, _in_expert = _in_expert, True
    try:
        yield
    finally:
        _in_expert = before


@contextlib.contextmanager
def gated_fc1() -> Iterator[None]:
    """Draws inside the block are a gated FC1's (see :data:`_gated_fc1`)."""
    global _gated_fc1
    before, _gated_fc1 = _gated_fc1, True
    try:
        yield
    finally:
        _gated_fc1 = before


def _tensor_parallel() -> tuple[int, int]:
    """(world size, rank) of the group the weight being drawn is split over."""
    if _in_expert:
        return (
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
        )
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


class LayoutIndependentInit:
    """``init_method`` wrapper: draw from :data:`INIT_STREAM`; fill a TP shard from its master."""

    def __init__(self, inner: Callable[[torch.Tensor], object]) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"LayoutIndependentInit({self.inner!r})"

    def _draw(self, shape: torch.Size) -> torch.Tensor:
        master = torch.empty(shape, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):  # the CPU generator is the stream for one call
            torch.default_generator.set_state(INIT_STREAM.get_state())
            self.inner(master)
            INIT_STREAM.set_state(torch.default_generator.get_state())
        return master

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if not getattr(weight, "tensor_model_parallel", False):
            # a whole tensor: the host path's master, or a weight that is not split
            with torch.no_grad():
                weight.copy_(self._draw(weight.shape))
            return weight
        dim, stride = weight.partition_dim, weight.partition_stride
        if _gated_fc1 and dim == 0 and stride == 1:
            stride = 2
        world, rank = _tensor_parallel()
        shape = list(weight.shape)
        shape[dim] *= world
        master = self._draw(torch.Size(shape))
        # as _initialize_affine_weight_cpu: stride-sized pieces, every world-th one is this rank's
        pieces = torch.split(master, weight.shape[dim] // stride, dim=dim)
        with torch.no_grad():
            weight.copy_(torch.cat(pieces[rank::world], dim=dim))
        return weight


def wrap_init_methods(config) -> None:
    """Wrap every init method ``config`` carries (``embedding_init_method`` where it exists)."""
    for name in ("init_method", "output_layer_init_method", "embedding_init_method"):
        inner = getattr(config, name, None)
        if inner is not None and not isinstance(inner, LayoutIndependentInit):
            setattr(config, name, LayoutIndependentInit(inner))
