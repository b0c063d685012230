"""``--use-megatron-fsdp``: Megatron-FSDP, megatron-core's own sharding of parameters, gradients
and optimizer states over the data-parallel group (megatron-core 0.15+; 0.14's reads DeviceMesh
state torch 2.13 removed, and 0.13's forerunner ``--use-custom-fsdp`` scales gradients inside
NCCL's PREMUL_SUM: both are refused by :func:`problems`).

Megatron-FSDP runs its collectives through the process group (HCCL on the NPU, gloo on cpu and
npu-emulated) and its streams through ``torch.cuda``, which the device namespace patches already
route. The gradient reduce and the checkpoint need more:

* **gradient reduce**: with ``--gradient-reduce-div-fusion`` (Megatron's default) and non-bf16
  gradients, Megatron-FSDP reduce-scatters with NCCL's ``PREMUL_SUM`` (each rank's gradient
  multiplied by the scaling factor inside the collective). HCCL and gloo have no such op: the
  gradient is multiplied first and then summed, the arithmetic Megatron itself does for bf16
  gradients and with ``--no-gradient-reduce-div-fusion``.
* **which buffer is scaled on megatron-core 0.14 and 0.15**: there Megatron-FSDP hands the
  reduce preprocessing its own gradient shard (``gbuf.data``) in place of the bucket it reduces.
  Under NCCL's ``PREMUL_SUM`` that buffer is never touched (by Megatron's code the collective
  scales what it sums, so on a GPU the gradient is averaged); scaled as above, the fully sharded
  strategies (``optim_grads``, ``optim_grads_params``) would reduce unscaled buckets and scale
  the shard instead, so the gradient is not the ranks' average. For the buckets that
  ``PREMUL_SUM`` would serve, the adaptor scales the bucket itself before the reduce and reduces
  it as a plain sum. Where Megatron itself scales first (bf16 gradients,
  ``--no-gradient-reduce-div-fusion``) its code scales the shard on a GPU too: that stays
  Megatron's own arithmetic. From 0.16 Megatron-FSDP hands over the bucket.
* **optimizer checkpoints** (``--ckpt-format fsdp_dtensor``): a rank whose shard of a parameter is
  empty gets no gradient for it, so torch's Adam never creates its state there, and the ranks'
  optimizer state dicts hold different DTensors. Megatron-FSDP's checkpoint preprocessing runs one
  collective per DTensor, so the ranks wait on different collectives and the save hangs (Megatron's
  own code, on a GPU too: NVIDIA/Megatron-LM#4910). The state dict the checkpoint saves and loads
  gets, on every rank, an entry for every parameter in parameter order: an empty shard's moments are
  empty DTensors, which write and read nothing, and its step is left to the rank holding the shard
  (Adam keeps a step per parameter, and the ranks' must not disagree).

* **model checkpoints on megatron-core 0.15**: there Megatron-FSDP swaps the module's parameters
  to the gathered (raw) ones in every forward and after every optimizer step
  (``start_param_sync``), and back to the sharded DTensors through a ``state_dict`` pre-hook on
  the wrapped module. Under ``--bf16`` or ``--fp16`` that module is Megatron's ``Float16Module``,
  whose ``state_dict`` hands the call straight to its inner model, so the hook never runs: the
  checkpoint takes the raw parameters, and the optimizer's part, which names its DTensors through
  the model's parameters, stops at Megatron's "not found in param_to_name mapping" assertion
  (Megatron's own code: its optimizer calls ``start_param_sync`` after every Megatron-FSDP step,
  whatever ``--overlap-param-gather`` says). The wrapper makes ``MegatronFSDP.state_dict`` swap
  to the DTensors first; the next forward swaps back. From 0.16 Megatron-FSDP registers the
  pre-hook on every submodule, so the inner model's ``state_dict`` runs it.

On the host-only devices (cpu, npu-emulated) the parameter gathers complete before Megatron-FSDP
goes on. It issues them as one asynchronous coalesced all-gather into buckets whose storage it
frees and re-allocates in place (``_typed_storage()._resize_``), trusting CUDA's stream-ordered
caching allocator to keep memory an in-flight collective writes. gloo writes from its own worker
threads with nothing holding that memory, and the heap is corrupted (``malloc(): unaligned
tcache chunk detected``, SIGSEGV). HCCL on the NPU works on streams, as NCCL does, and keeps the
overlap.

With gradient-accumulation fusion (Megatron's default) the linear layers' backward writes each
weight gradient, a 16-bit product under ``--bf16``, into Megatron-FSDP's fp32 buffer:
``torch.matmul(..., out=)`` up to megatron-core 0.17 (served by the ``matmul.*`` entries on the
CPU stand-ins; on the NPU it is torch_npu's own matmul into that buffer, not checked on hardware),
Transformer Engine's GEMM from 0.18 (``transformer-engine.general-gemm``, every device). From
0.17 Megatron-FSDP's adapter asserts Transformer Engine 2.10 for it; the adaptor answers that
one question (:func:`is_te_min_version`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_npu.devices.facts import CPU, DEVICES, NPU_EMULATED
from megatron_npu.registry import Patch


@torch.no_grad()
def gradient_reduce_preprocessing(grad_data: torch.Tensor, scaling_factor: Any, ddp_config: Any):
    """The reduce op for Megatron-FSDP's gradient reduce-scatter, scaling ``grad_data`` in place
    where the op does not: no factor, a plain sum; ``average_in_collective``, the group average;
    otherwise the gradient times the factor, summed."""
    if scaling_factor is None:
        return torch.distributed.ReduceOp.SUM
    if ddp_config.average_in_collective:
        return torch.distributed.ReduceOp.AVG
    grad_data.mul_(scaling_factor)
    return torch.distributed.ReduceOp.SUM


#: the Transformer Engine release megatron-core's Megatron-FSDP adapter asks for when
#: gradient-accumulation fusion is on (0.17+): its weight-gradient GEMM into the fp32 buffer
FSDP_WGRAD_TE_VERSION = "2.10"


def is_te_min_version(version: Any, check_equality: bool = True) -> bool:
    """``megatron.core.utils.is_te_min_version`` as the Megatron-FSDP adapter sees it: the
    release its weight-gradient GEMM needs is served by the adaptor; any other question is
    answered by the installed Transformer Engine, as before."""
    if str(version) == FSDP_WGRAD_TE_VERSION:
        return True
    from megatron.core.utils import is_te_min_version as installed

    return installed(version, check_equality)


def _gathers_unsharded_weights() -> bool:
    """Whether the installed Megatron-FSDP's post-step parameter gather knows ``no_shard``
    (megatron-core 0.18+; before, it fetches a sharded weight buffer that ``no_shard`` does not
    build, unless the gather overlaps the next forward)."""
    import inspect

    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    return "no_shard" in inspect.getsource(MegatronFSDP.start_param_sync)


def _reads_removed_mesh_state() -> bool:
    """Whether the installed Megatron-FSDP names a device mesh's sub-meshes only from torch's
    private ``_mesh_resources.child_to_root_mapping`` (megatron-core 0.14), which torch no
    longer has (2.13); 0.15+ asks the root mesh first."""
    import inspect

    from torch.distributed.device_mesh import _mesh_resources

    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import utils
    except ImportError:  # no Megatron-FSDP at all (megatron-core 0.13)
        return False
    source = inspect.getsource(utils.get_mesh_names)
    return "_get_root_mesh" not in source and not hasattr(_mesh_resources, "child_to_root_mapping")


def _hands_gradients_to_decoupled_grad() -> bool:
    """Whether the installed Megatron-FSDP can give the optimizer its gradients in
    ``decoupled_grad`` (megatron-core 0.18+: ``megatron_fsdp_use_decoupled_grad``), where the
    precision-aware optimizer reads them."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return "megatron_fsdp_use_decoupled_grad" in DistributedDataParallelConfig.__dataclass_fields__


def problems(args: Any) -> list[str]:
    """What of Megatron-LM's ``args`` the adaptor refuses, as ``"--option: why"``: core_v0.13's
    ``--use-custom-fsdp`` (its Megatron-LM has no ``--use-megatron-fsdp`` yet) scales the gradient
    inside NCCL's PREMUL_SUM, and where it scales before the collective instead (bf16 gradients)
    it scales the local shard's buffer rather than the bucket it reduces; megatron-core 0.14's
    Megatron-FSDP needs DeviceMesh state torch 2.13 removed; Megatron-FSDP's ``no_shard`` fails
    after the first step in Megatron's own code up to megatron-core 0.17, unless
    ``--overlap-param-gather`` takes the other path; megatron-core 0.15's Megatron-FSDP stops in
    the backward of a tied output layer with gradient-accumulation fusion (one pipeline stage);
    the precision-aware optimizer: before megatron-core 0.18 Megatron-FSDP hands it its gradients
    in ``.grad`` where it reads ``decoupled_grad``, so no parameter would ever be updated, and
    from 0.18 its parameters are DTensors, which the adaptor's precision-aware optimizer does not
    step."""
    if getattr(args, "use_megatron_fsdp", False) and _reads_removed_mesh_state():
        from megatron_npu.patcher import megatron_core_version

        return [
            f"--use-megatron-fsdp: megatron-core {megatron_core_version()}'s Megatron-FSDP reads "
            f"torch's private DeviceMesh state (_mesh_resources.child_to_root_mapping), which "
            f"torch {torch.__version__} no longer has (on any device): use megatron-core 0.15+, "
            "or shard the optimizer states with --use-distributed-optimizer"
        ]
    if (
        getattr(args, "use_megatron_fsdp", False)
        and getattr(args, "data_parallel_sharding_strategy", None) == "no_shard"
        and not getattr(args, "overlap_param_gather", False)
        and not _gathers_unsharded_weights()
    ):
        from megatron_npu.patcher import megatron_core_version

        return [
            "--data-parallel-sharding-strategy no_shard: megatron-core "
            f"{megatron_core_version()}'s Megatron-FSDP gathers the parameters after each step "
            "from a sharded weight buffer that no_shard does not build (Megatron's own code, on "
            "any device): add --overlap-grad-reduce --overlap-param-gather, or shard with optim, "
            "optim_grads or optim_grads_params"
        ]
    if getattr(args, "use_megatron_fsdp", False) and getattr(
        args, "use_precision_aware_optimizer", False
    ):
        from megatron_npu.patcher import megatron_core_version

        why = (
            "gives the optimizer its gradients in .grad, and the precision-aware optimizer reads "
            "decoupled_grad, so no parameter would be updated (Megatron's own code, on any device)"
            if not _hands_gradients_to_decoupled_grad()
            else "hands the optimizer DTensor parameters, which the adaptor's precision-aware "
            "optimizer does not step"
        )
        return [
            f"--use-precision-aware-optimizer: megatron-core {megatron_core_version()}'s "
            f"Megatron-FSDP {why}: use --use-distributed-optimizer for the precision-aware "
            "optimizer, or Megatron-FSDP with torch's Adam"
        ]
    if (
        getattr(args, "use_megatron_fsdp", False)
        and _ties_the_output_to_fused_gradient_buffer(args)
        and not _gives_the_shared_weight_a_buffer()
    ):
        from megatron_npu.patcher import megatron_core_version

        return [
            f"--use-megatron-fsdp: megatron-core {megatron_core_version()}'s Megatron-FSDP with "
            "tied embeddings and gradient-accumulation fusion stops in the output layer's "
            "backward, which finds no gradient buffer (main_grad) for the shared weight: add "
            "--untie-embeddings-and-output-weights or --no-gradient-accumulation-fusion, or use "
            "megatron-core 0.16+"
        ]
    if getattr(args, "use_custom_fsdp", False) and not hasattr(args, "use_megatron_fsdp"):
        return [
            "--use-custom-fsdp: megatron-core 0.13's FSDP scales gradients inside NCCL's "
            "PREMUL_SUM reduce-scatter, which HCCL and gloo lack, and its own fallback scales "
            "another buffer than the one it reduces: use --use-distributed-optimizer "
            "(megatron-core 0.15+ serves --use-megatron-fsdp)"
        ]
    return []


def _ties_the_output_to_fused_gradient_buffer(args: Any) -> bool:
    """Whether the output layer of Megatron-LM's ``args`` computes its weight gradient, fused into
    the gradient buffer, for the weight it shares with the embedding (tied embeddings, one
    pipeline stage, gradient-accumulation fusion)."""
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    one_stage = (getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1
    return tied and one_stage and bool(getattr(args, "gradient_accumulation_fusion", False))


def _gives_the_shared_weight_a_buffer() -> bool:
    """Whether the installed Megatron-FSDP serves the fused weight gradient of a tied output layer:
    every release but 0.15, whose backward finds no ``main_grad`` for the shared weight there (0.14
    was not run: on torch 2.13 its Megatron-FSDP is refused before this)."""
    from megatron_npu.patcher import megatron_core_below

    return megatron_core_below("0.15") or not megatron_core_below("0.16")


def notices(args: Any) -> list[str]:
    """What of Megatron-LM's ``args`` Megatron-FSDP computes differently from the distributed
    optimizer in Megatron's own code, on any device, as lines to warn with."""
    if not getattr(args, "use_megatron_fsdp", False):
        return []
    if _ties_the_output_to_fused_gradient_buffer(args):
        return [
            "megatron-npu: with --use-megatron-fsdp, tied embeddings and gradient-accumulation "
            "fusion, Megatron's output layer writes the shared weight's gradient buffer and marks "
            "it filled, so Megatron-FSDP drops the embedding's share of that gradient (Megatron's "
            "own code, on a GPU too); --untie-embeddings-and-output-weights or "
            "--no-gradient-accumulation-fusion keep both shares"
        ]
    return []


def _empty_here(param: Any) -> bool:
    """Whether this rank's shard of ``param`` (a DTensor's local tensor) holds nothing."""
    return getattr(param, "_local_tensor", param).numel() == 0


def _shaped_like(param: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The states in ``state`` shaped like ``param`` (moments, master weights; not per-parameter
    scalars such as Adam's ``step``)."""
    return {
        name: value
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape
    }


def _empty_states_like(param: Any, holder: Any, kept: dict[str, Any]) -> dict[str, Any]:
    """Empty states for ``param`` of each kind ``holder`` keeps (``kept``): in ``param``'s dtype
    where the holder's state is in the holder's own (torch's Adam keeps its moments so), else in
    the state's."""
    return {
        name: torch.zeros_like(
            param, dtype=param.dtype if value.dtype == holder.dtype else value.dtype
        )
        for name, value in kept.items()
    }


def _first_holder(optimizer: Any, params: list[Any]) -> tuple[Any, dict[str, Any]] | None:
    """(the first of ``params`` the optimizer keeps states shaped like, those states)."""
    for param in params:
        kept = _shaped_like(param, optimizer.state.get(param, {}))
        if kept:
            return param, kept
    return None


def every_parameters_state(optimizer: Any) -> list[tuple[Any, dict[str, Any]]]:
    """(parameter, the state a checkpoint keeps of it) for every parameter of ``optimizer``, in
    parameter order. A parameter whose shard here is empty never had a gradient here: its entry
    holds only the states shaped like it, and where the optimizer keeps none, one of each kind
    it keeps of another parameter on this rank (of the same group where one has state), as
    empty tensors; no per-parameter scalar such as Adam's step, so that the rank holding its
    shard alone says what those are. A rank with no state at all (before the first step) gives
    none, as every rank then does."""
    groups = [list(group["params"]) for group in optimizer.param_groups]
    anywhere = _first_holder(optimizer, [param for params in groups for param in params])
    out = []
    for params in groups:
        holder = _first_holder(optimizer, params) or anywhere
        for param in params:
            state = optimizer.state.get(param, {})
            if _empty_here(param):
                state = _shaped_like(param, state) or (
                    _empty_states_like(param, *holder) if holder is not None else {}
                )
            out.append((param, state))
    return out


def give_empty_shards_a_step(state: dict[Any, dict[str, Any]]) -> None:
    """Before the optimizer loads ``state`` (per parameter): an entry that lacks a scalar the
    other entries hold (an empty shard's, see :func:`every_parameters_state`; Adam's ``step``,
    which torch's Adam reads on load and never uses, the shard being empty) takes it from the
    first entry that has it."""
    entries = [entry for entry in state.values() if isinstance(entry, dict) and entry]
    scalars: dict[str, Any] = {}
    for entry in entries:
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                scalars.setdefault(name, value)
    for entry in entries:
        for name, value in scalars.items():
            if name not in entry:
                entry[name] = value.clone() if isinstance(value, torch.Tensor) else value


def _scaled_inside_the_collective(gbuf: Any) -> bool:
    """Whether Megatron-FSDP reduces the gradient buffer ``gbuf`` with NCCL's ``PREMUL_SUM`` (the
    scaling factor applied inside the collective): a factor, no average in the collective, the
    div fusion, and gradients other than bf16."""
    config = gbuf.ddp_config
    return (
        gbuf.gradient_scaling_factor is not None
        and not config.average_in_collective
        and config.gradient_reduce_div_fusion
        and gbuf.dtype != torch.bfloat16
    )


def _wrap_bucket_group_reduce(original: Any) -> Any:
    """``GradReducePipeline._bucket_group_gradient_reduce`` with each bucket that NCCL would scale
    inside ``PREMUL_SUM`` scaled by its buffer's factor first, and reduced as a plain sum (its
    buffer's factor cleared for the call, so the preprocessing scales nothing else)."""

    @functools.wraps(original)
    def _bucket_group_gradient_reduce(
        self: Any,
        bucket_group: list[int],
        async_op: bool = False,
        outer_fsdp_group_grad_reduce: bool = False,
    ) -> bool:
        scaled: dict[int, tuple[Any, Any]] = {}
        try:
            with torch.no_grad():
                for bucket_id in bucket_group:
                    gbuf = self.get_fsdp_buffer(bucket_id)
                    if id(gbuf) in scaled or not _scaled_inside_the_collective(gbuf):
                        continue
                    gbuf.fetch_bucket().data.mul_(gbuf.gradient_scaling_factor)
                    scaled[id(gbuf)] = (gbuf, gbuf.gradient_scaling_factor)
                    gbuf.gradient_scaling_factor = None
            return original(self, bucket_group, async_op, outer_fsdp_group_grad_reduce)
        finally:
            for gbuf, factor in scaled.values():
                gbuf.gradient_scaling_factor = factor

    return _bucket_group_gradient_reduce


def _synchronous_coalescing(original: Any) -> Any:
    """torch's ``_coalescing_manager`` as Megatron-FSDP's buffers call it, with the coalesced
    collectives waited for when the block ends (``async_ops`` off), however they were asked."""

    @functools.wraps(original)
    def _coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
        return original(group, device, async_ops=False)

    return _coalescing_manager


def _wrap_state_dict_sharded_first(original: Any) -> Any:
    @functools.wraps(original)
    def state_dict(
        self: Any, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        self._replace_param_with_distributed_if_needed()
        return original(self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    return state_dict


def _wrap_fsdp_dtensor_state(original: Any) -> Any:
    @functools.wraps(original)
    def sharded_param_state_fsdp_dtensor(self: Any, is_loading: bool = False) -> dict[str, Any]:
        state_dict = original(self, is_loading)
        packed = {
            self._param_name(param): state
            for param, state in every_parameters_state(self.optimizer)
        }
        for key, value in state_dict["state"].items():  # anything not keyed by a parameter
            packed.setdefault(key, value)
        state_dict["state"] = packed
        return state_dict

    return sharded_param_state_fsdp_dtensor


_REDUCE_EXEMPT = (
    "a collective's reduce op, no numerics of its own: the gradient times the factor, summed, "
    "is Megatron's own arithmetic for bf16 gradients; the named test trains Megatron-LM with "
    "Megatron-FSDP against the distributed optimizer"
)
_TRAINS_AS_DISTOPT = (
    "tests/megatron_lm/test_pretrain_gpt.py::"
    "test_megatron_fsdp_trains_as_the_distributed_optimizer_and_resumes_bitwise"
)

_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"

PATCHES = [
    Patch(
        id="megatron-fsdp.gradient-reduce-op",
        target=f"{_BUFFER}.gradient_reduce_preprocessing",
        replacement=gradient_reduce_preprocessing,
        reason="Megatron-FSDP reduce-scatters with NCCL's PREMUL_SUM, which HCCL and gloo lack: "
        "scale the gradient, then sum",
        versions=">=0.14",
        parity_exempt=_REDUCE_EXEMPT,
        benchmark_exempt="picks a reduce op; the scaling is one in-place multiply",
        exempt_test=_TRAINS_AS_DISTOPT,
    ),
    Patch(
        id="megatron-fsdp.scale-the-reduced-bucket",
        target=f"{_BUFFER}.GradReducePipeline._bucket_group_gradient_reduce",
        replacement=_wrap_bucket_group_reduce,
        kind="wrap",
        reason="megatron-core 0.14 and 0.15's Megatron-FSDP hand the reduce preprocessing their "
        "own shard for the bucket they reduce: scaled there in place of PREMUL_SUM, sharded "
        "gradients would not be the ranks' average; scale the bucket",
        versions=">=0.14,<0.16",
        parity_exempt="the bucket times the factor, summed: PREMUL_SUM's arithmetic, held by the "
        "named test against the distributed optimizer's grad norms",
        benchmark_exempt="one in-place multiply per bucket, where the collective would scale",
        exempt_test=_TRAINS_AS_DISTOPT,
    ),
    Patch(
        id="megatron-fsdp.synchronous-gathers",
        target=f"{_BUFFER}._coalescing_manager",
        replacement=_synchronous_coalescing,
        kind="wrap",
        reason="gloo's asynchronous parameter gathers write into buckets Megatron-FSDP frees "
        "meanwhile (CUDA's stream-ordered allocator keeps them on a GPU): wait at the block's end",
        versions=">=0.14",
        devices=frozenset({CPU, NPU_EMULATED}),
        check_signature=False,  # contextlib's helper takes (*args, **kwds)
        rebind_copies=False,  # torch's own and other modules' copies stay asynchronous
        parity_exempt="ordering of collectives, no numerics: the same gathers, waited for",
        benchmark_exempt="the host-only devices' gathers: no overlap to lose on gloo",
        exempt_test="tests/patches/test_megatron_fsdp.py::"
        "test_coalesced_gathers_on_a_host_device_are_complete_when_the_block_ends",
    ),
    Patch(
        id="megatron-fsdp.te-weight-gradient-gemm",
        target="megatron.core.distributed.fsdp.mcore_fsdp_adapter.is_te_min_version",
        replacement=is_te_min_version,
        reason="Megatron-FSDP with gradient-accumulation fusion asserts TE 2.10 for its "
        "weight-gradient GEMM into the fp32 buffer, which the adaptor serves",
        versions=">=0.17",
        rebind_copies=False,  # megatron.core.utils' own and every other copy stay as they are
        parity_exempt="a capability answer, no numerics: the GEMM it vouches for has the "
        "gradient-accumulation-fusion parity case; the named test trains with it",
        benchmark_exempt="read once, when Megatron-FSDP wraps the model",
        exempt_test=_TRAINS_AS_DISTOPT,
    ),
    Patch(
        id="megatron-fsdp.save-sharded-parameters",
        target="megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP."
        "state_dict",
        replacement=_wrap_state_dict_sharded_first,
        kind="wrap",
        reason="Float16Module's state_dict skips Megatron-FSDP's pre-hook: a 16-bit model saves "
        "its gathered parameters and the optimizer's fsdp_dtensor state cannot name its DTensors",
        versions=">=0.15,<0.16",
        devices=DEVICES,
        parity_exempt="checkpoint plumbing, no numerics: the sharded parameters swapped in first",
        benchmark_exempt="runs once per checkpoint save",
        exempt_test=_TRAINS_AS_DISTOPT,
    ),
    Patch(
        id="megatron-fsdp.optimizer-state-every-parameter",
        target="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
        "sharded_param_state_fsdp_dtensor",
        replacement=_wrap_fsdp_dtensor_state,
        kind="wrap",
        reason="a rank with an empty shard has no optimizer state for it: the fsdp_dtensor "
        "checkpoint's per-DTensor collectives part and the save hangs",
        versions=">=0.14",
        devices=DEVICES,
        parity_exempt="checkpoint plumbing, no numerics: empty moments of empty shards",
        benchmark_exempt="runs once per checkpoint save or load",
        exempt_test=_TRAINS_AS_DISTOPT,
    ),
]
