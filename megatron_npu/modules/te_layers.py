"""Transformer Engine's layer classes, as Megatron's TE spec builds them, without TE.

Without NVIDIA Transformer Engine, ``megatron.core.extensions.transformer_engine`` still imports
but its ``TE*`` names are placeholders (``MagicMock`` objects, or a ``TENorm`` that raises), so
Megatron's default ``transformer_engine`` layer spec cannot be built. These classes take their
place (:mod:`megatron_npu.patches.transformer_engine`): the same constructor arguments, the same
``forward`` contract (``(output, bias or None)`` for the linears), and the parameter names,
shapes, tensor-parallel attributes and checkpoint keys TE's own modules have, so a checkpoint
written by a GPU run with TE maps key for key:

- ``TELayerNormColumnParallelLinear``: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm
  only), ``weight``, ``bias``, ``_extra_state``; the norm runs on the local (sequence-parallel)
  shard before the column-parallel GEMM gathers it, and its parameters are replicated across TP
  and marked ``sequence_parallel`` as TE marks them;
- ``TEColumnParallelLinear`` / ``TERowParallelLinear``: ``weight``, ``bias``, ``_extra_state``
  (TP axis 0 / 1); ``TELinear`` with ``parallel_mode="duplicated"``: a replicated ``weight``;
- ``TENorm``: ``weight``, ``bias`` (LayerNorm only), ``_extra_state``;
- ``TEDotProductAttention``: ``_extra_state`` in its ``state_dict``, none in the sharded one
  from megatron-core 0.15 (TE's wrapper saves only a learnable softmax offset there), and a
  missing one is not an error when loaded (TE's own load hook);
- ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (MoE experts with
  ``--moe-grouped-gemm``): ``weight0`` ... ``weight{n-1}`` (``bias0`` ...) and one
  ``_extra_state``; in distributed checkpoints one entry per global expert, sharded along the
  expert axis exactly as Megatron's ``TEGroupedLinear._sharded_state_dict_grouped`` writes them.

The compute is Megatron's own local layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``DotProductAttention``: TP/SP communication, gradient-accumulation fusion into ``main_grad``,
the adaptor's fused-attention routing), the adaptor's norm op (``npu_rms_norm`` on the NPU) and
its grouped GEMM (``npu_grouped_matmul``: one call per direction for all local experts).

``_extra_state`` is TE's fp8 metadata. With fp8 off TE writes an empty ``uint8`` tensor (TE 2.4+;
its norms from 2.9, before that ``pickle.dumps({})``); these classes write the same and load every
form TE ever wrote for a run without fp8 state. A checkpoint holding real fp8 state is refused
with a named error: the adaptor trains without fp8.
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
from typing import Any

import torch

from megatron_npu.devices.torch_namespace import TORCH_NAMESPACE
from megatron_npu.modules.norm import Norm, normalize

#: TE's ``_extra_state`` payloads that carry no fp8 state: ``pickle.dumps(None)`` (TE 2.0-2.3
#: modules) and ``pickle.dumps({})`` (TE < 2.9 norms)
_EMPTY_PICKLES = (pickle.dumps(None, protocol=4), pickle.dumps({}, protocol=4))


class FP8StateError(ValueError):
    """A checkpoint's TE ``_extra_state`` holds fp8 scaling state."""


def _device() -> Any:
    """Where Megatron's device-path initialisation puts a weight: its
    ``torch.cuda.current_device()`` as the device layer answers it (the NPU, the CPU for the
    stand-in devices)."""
    return TORCH_NAMESPACE.cuda.current_device()


class TEExtraState:
    """The ``_extra_state`` entry of a TE module with fp8 off."""

    #: the norms of TE < 2.9 (megatron-core 0.13/0.14's TE) pickle an empty dict instead
    pickled_empty_dict = False

    def get_extra_state(self) -> torch.Tensor:
        if self.pickled_empty_dict:
            return torch.frombuffer(bytearray(_EMPTY_PICKLES[1]), dtype=torch.uint8)
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        if state is None:
            return
        if isinstance(state, io.BytesIO):  # TE 1.x: torch.save(None) in a buffer
            state.seek(0)
            if torch.load(state, weights_only=True) is None:
                return
        elif isinstance(state, torch.Tensor):
            if state.numel() == 0 or state.cpu().numpy().tobytes() in _EMPTY_PICKLES:
                return
        raise FP8StateError(
            f"{type(self).__name__}: the checkpoint's _extra_state holds Transformer Engine fp8 "
            "state (a run with --fp8-format); the adaptor trains without fp8, so it cannot "
            "resume that state: convert the checkpoint without fp8 or start the fp8 run on a GPU"
        )


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Those of ``kwargs`` that ``cls.__init__`` of the installed megatron-core takes (each
    release adds or drops a few, e.g. ``tp_group``, ``stride``)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


# ---------------------------------------------------------------------------- linears


def _column_parallel_linear() -> type:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


def _row_parallel_linear() -> type:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return RowParallelLinear


def _check_te_arguments(
    name: str,
    *,
    gather_output: bool = False,
    input_is_parallel: bool = True,
    skip_weight_param_allocation: bool = False,
) -> None:
    """The arguments TE's wrappers refuse, refused the same way (ValueError)."""
    if gather_output:
        raise ValueError(
            f"Transformer Engine linear layers do not support gather_output = True ({name})"
        )
    if not input_is_parallel:
        raise ValueError(
            f"Transformer Engine linear layers do not support input_is_parallel = False ({name})"
        )
    if skip_weight_param_allocation:
        raise ValueError(
            f"Transformer Engine linear layers do not support skip_weight_param_allocation ({name})"
        )


def _build_linears() -> dict[str, type]:
    column, row = _column_parallel_linear(), _row_parallel_linear()

    class TEColumnParallelLinear(TEExtraState, column):
        """TE's column-parallel linear: Megatron's ColumnParallelLinear plus ``_extra_state``."""

        def __init__(
            self,
            input_size: int,
            output_size: int,
            *,
            config,
            init_method,
            gather_output: bool,
            bias: bool,
            skip_bias_add: bool,
            is_expert: bool,
            skip_weight_param_allocation: bool = False,
            tp_comm_buffer_name=None,
            tp_group=None,
            stride: int = 1,
            name=None,
            **_te_only: Any,
        ) -> None:
            _check_te_arguments(
                type(self).__name__,
                gather_output=gather_output,
                skip_weight_param_allocation=skip_weight_param_allocation,
            )
            super().__init__(
                input_size,
                output_size,
                **_accepted(
                    column,
                    dict(
                        config=config,
                        init_method=init_method,
                        bias=bias,
                        gather_output=False,
                        stride=stride,
                        skip_bias_add=skip_bias_add,
                        is_expert=is_expert,
                        tp_comm_buffer_name=tp_comm_buffer_name,
                        tp_group=tp_group,
                    ),
                ),
            )

    class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
        """TE's LayerNormLinear: the input norm fused into the column-parallel GEMM (QKV, FC1).

        The norm's ``layer_norm_weight`` / ``layer_norm_bias`` come first in the state dict, as
        TE registers them; ``--apply-layernorm-1p`` stores gamma zero-centred (init 0)."""

        def __init__(
            self,
            input_size: int,
            output_size: int,
            *,
            config,
            init_method,
            gather_output: bool,
            bias: bool,
            skip_bias_add: bool,
            is_expert: bool,
            skip_weight_param_allocation: bool = False,
            tp_comm_buffer_name=None,
            tp_group=None,
            stride: int = 1,
            name=None,
            **_te_only: Any,
        ) -> None:
            if is_expert:
                raise ValueError("Transformer Engine linear layers do not yet support MoE")
            super().__init__(
                input_size,
                output_size,
                config=config,
                init_method=init_method,
                gather_output=gather_output,
                bias=bias,
                skip_bias_add=skip_bias_add,
                is_expert=False,
                skip_weight_param_allocation=skip_weight_param_allocation,
                tp_comm_buffer_name=tp_comm_buffer_name,
                tp_group=tp_group,
                stride=stride,
            )
            self.normalization = config.normalization
            if self.normalization not in ("LayerNorm", "RMSNorm"):
                raise ValueError(
                    f"normalization must be LayerNorm or RMSNorm, got {self.normalization!r}"
                )
            self.eps = config.layernorm_epsilon
            self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
            device = self.weight.device
            init = torch.zeros if self.zero_centered_gamma else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(
                init(input_size, dtype=config.params_dtype, device=device)
            )
            if self.normalization == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(
                    torch.zeros(input_size, dtype=config.params_dtype, device=device)
                )
            else:
                self.layer_norm_bias = None
            for param in (self.layer_norm_weight, self.layer_norm_bias):
                if param is not None:
                    param.sequence_parallel = config.sequence_parallel
            for key in ("weight", "bias"):  # TE's order: the norm's parameters first
                if key in self._parameters:
                    self._parameters[key] = self._parameters.pop(key)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
            normed = normalize(
                x,
                self.layer_norm_weight,
                self.layer_norm_bias,
                self.normalization,
                self.eps,
                self.zero_centered_gamma,
            )
            return super().forward(normed, *args, **kwargs)

    class TERowParallelLinear(TEExtraState, row):
        """TE's row-parallel linear: Megatron's RowParallelLinear plus ``_extra_state``."""

        def __init__(
            self,
            input_size: int,
            output_size: int,
            *,
            config,
            init_method,
            bias: bool,
            input_is_parallel: bool,
            skip_bias_add: bool,
            is_expert: bool,
            tp_comm_buffer_name=None,
            tp_group=None,
            name=None,
            **_te_only: Any,
        ) -> None:
            _check_te_arguments(type(self).__name__, input_is_parallel=input_is_parallel)
            super().__init__(
                input_size,
                output_size,
                **_accepted(
                    row,
                    dict(
                        config=config,
                        init_method=init_method,
                        bias=bias,
                        input_is_parallel=True,
                        skip_bias_add=skip_bias_add,
                        is_expert=is_expert,
                        tp_comm_buffer_name=tp_comm_buffer_name,
                        tp_group=tp_group,
                    ),
                ),
            )

    built = (TEColumnParallelLinear, TELayerNormColumnParallelLinear, TERowParallelLinear)
    for cls in built:
        cls.__qualname__ = cls.__name__
    return {cls.__name__: cls for cls in built}


_built: dict[str, type] = {}


def stand_in(name: str) -> type:
    """The stand-in class named ``name`` (``TEColumnParallelLinear``, ...). The ones built on
    megatron-core's local layers are defined on first use, on the installed release's classes."""
    if name not in _built:
        if name == "TEDotProductAttention":
            _built[name] = _build_attention()
        elif name in (
            "TELinear",
            "TENorm",
            "TEGroupedLinear",
            "TEColumnParallelGroupedLinear",
            "TERowParallelGroupedLinear",
        ):
            _built[name] = globals()[name]
        else:
            _built.update(_build_linears())
    return _built[name]


class TELinear(TEExtraState, torch.nn.Module):
    """TE's plain linear. ``parallel_mode="duplicated"`` (or None, how megatron-core builds the
    MLA down-projections) is a weight replicated on every TP rank; ``"column"`` / ``"row"``
    build the column- / row-parallel stand-in."""

    def __new__(
        cls,
        input_size: int = 0,
        output_size: int = 0,
        *args: Any,
        parallel_mode: str | None = None,
        **kwargs: Any,
    ):
        if cls is TELinear and parallel_mode in ("column", "row"):
            name = "TEColumnParallelLinear" if parallel_mode == "column" else "TERowParallelLinear"
            kwargs.pop("symmetric_ar_type", None)
            if parallel_mode == "column":
                kwargs.setdefault("gather_output", False)
            else:
                _check_te_arguments(
                    "TELinear",
                    skip_weight_param_allocation=kwargs.pop("skip_weight_param_allocation", False),
                )
                kwargs.setdefault("input_is_parallel", True)
            kwargs.setdefault("is_expert", False)
            return stand_in(name)(input_size, output_size, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name=None,
        is_expert: bool = False,
        symmetric_ar_type=None,
        tp_group=None,
        name=None,
        **_te_only: Any,
    ) -> None:
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"TELinear: unknown parallel_mode {parallel_mode!r}")
        _check_te_arguments("TELinear", skip_weight_param_allocation=skip_weight_param_allocation)
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.config = config
        self.skip_bias_add = skip_bias_add
        device = "cpu" if config.use_cpu_initialization else _device()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        set_tensor_model_parallel_attributes(self.weight, False, 0, 1)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(output_size, dtype=config.params_dtype, device=device)
            )
        else:
            self.bias = None
        for param in (self.weight, self.bias):
            if param is not None:
                param.allreduce = not is_expert
                param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        out = torch.nn.functional.linear(x, self.weight, bias)
        return out, (self.bias if self.skip_bias_add else None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, None, sharded_offsets)


# -------------------------------------------------------------------------------- norm


class TENorm(TEExtraState, Norm):
    """TE's LayerNorm / RMSNorm as ``TENorm(config, hidden_size, eps)`` builds it."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        has_residual: bool = False,
        **_te_only: Any,
    ) -> None:
        if has_residual and getattr(config, "fused_residual_rmsnorm", False):
            # TE's TENorm builds its fused residual-add RMSNorm only with this option; a norm
            # asked for "with residual" is otherwise the plain one
            raise ValueError(
                "TENorm: the fused residual RMSNorm (--fused-residual-rmsnorm) is "
                "not supported by the adaptor"
            )
        super().__init__(
            hidden_size,
            eps=eps,
            normalization=config.normalization,
            zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )
        from megatron_npu.patcher import megatron_core_below

        self.pickled_empty_dict = megatron_core_below("0.15")


# --------------------------------------------------------------------------- attention


def _core_attention_extra_state_optional(module: Any, incompatible_keys: Any) -> None:
    """TE's own load hook on its DotProductAttention: a missing
    ``core_attention._extra_state`` is not an error (its fp8 metadata; none with fp8 off)."""
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if "core_attention._extra_state" not in key]


def _build_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class TEDotProductAttention(TEExtraState, DotProductAttention):
        """TE's core attention on Megatron's DotProductAttention (the adaptor routes it to the
        fused-attention op when the run asks for flash attention): [s, b, np, hn] q and
        [s, b, ng, hn] k/v (grouped-query heads expanded inside) -> [s, b, np * hn].
        Multi-latent attention's heads are ``k_channels`` wide in q/k and ``v_channels`` in v,
        and the output is [s, b, np * v_channels].

        It takes ``--context-parallel-size`` above 1 (which Megatron's own DotProductAttention
        refuses: TE's class is Megatron's only context-parallel attention) and keeps the layer's
        ``cp_comm_type`` and the context-parallel group; the registry entry
        ``transformer-engine.context-parallel-attention`` routes such calls to the
        context-parallel op (:mod:`megatron_npu.patches.context_parallel`)."""

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str,
            attention_dropout=None,
            softmax_scale=None,
            k_channels=None,
            v_channels=None,
            num_splits=None,
            cp_comm_type: str = "p2p",
            model_comm_pgs=None,
            pg_collection=None,
            **_te_only: Any,
        ) -> None:
            k_channels = k_channels or config.kv_channels
            v_channels = v_channels or config.kv_channels
            if softmax_scale is None:  # TE's default: over the query/key head dimension
                softmax_scale = 1.0 / math.sqrt(k_channels)
            context_parallel = getattr(config, "context_parallel_size", 1) > 1
            built_with = config
            if context_parallel or v_channels != config.kv_channels:
                built_with = copy.copy(config)
                # DotProductAttention asserts CP 1; this class serves CP
                built_with.context_parallel_size = 1
                # multi-latent attention: q/k heads of k_channels, v heads of v_channels; the
                # unfused math takes both, and its output is heads x v_channels wide
                built_with.kv_channels = v_channels
            super().__init__(
                built_with,
                layer_number,
                attn_mask_type,
                attention_type,
                **_accepted(
                    DotProductAttention,
                    dict(
                        attention_dropout=attention_dropout,
                        softmax_scale=softmax_scale,
                        cp_comm_type=cp_comm_type,
                        model_comm_pgs=model_comm_pgs,
                        pg_collection=pg_collection,
                    ),
                ),
            )
            self.config = config
            self.cp_comm_type = cp_comm_type or "p2p"
            self.cp_group = None
            # as TE's DotProductAttention: its _extra_state is left out of distributed
            # checkpoints (megatron-core 0.15+), so a strict load must not miss it
            self.register_load_state_dict_post_hook(_core_attention_extra_state_optional)
            if context_parallel:
                from megatron.core import parallel_state

                pgs = pg_collection if pg_collection is not None else model_comm_pgs
                if self.cp_comm_type == "a2a+p2p":  # TE's form: [all-to-all group, ring group]
                    self.cp_group = getattr(pgs, "hcp", None) or (
                        parallel_state.get_hierarchical_context_parallel_groups()
                    )
                else:
                    self.cp_group = (
                        getattr(pgs, "cp", None) or parallel_state.get_context_parallel_group()
                    )

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            num_splits=None,
        ):
            if self.cp_group is not None:  # never attention over the local rows alone
                raise RuntimeError(
                    "TEDotProductAttention: context parallelism is served by the "
                    "adaptor entry transformer-engine.context-parallel-attention, "
                    "which is not applied"
                )
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
            from megatron_npu.patcher import megatron_core_below

            # TE's wrapper keeps _extra_state out of distributed checkpoints from 0.15 on
            if megatron_core_below("0.15"):
                from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

                state = self.state_dict(prefix="", keep_vars=True)
                return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    TEDotProductAttention.__qualname__ = TEDotProductAttention.__name__
    return TEDotProductAttention


# ------------------------------------------------------------------------ grouped linears


def _expert_groups(pg_collection: Any, tp_group: Any) -> tuple[Any, int, int, int]:
    """(expert-TP group, expert-TP size, EP size, EP rank) from ``pg_collection`` (megatron-core
    0.16+), else from ``tp_group`` / parallel_state (earlier releases)."""
    from megatron.core import parallel_state as ps

    if pg_collection is not None:
        group, ep = pg_collection.expt_tp, pg_collection.ep
        return group, group.size(), ep.size(), ep.rank()
    group = tp_group if tp_group is not None else ps.get_expert_tensor_parallel_group()
    return (
        group,
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
    )


class TEGroupedLinear(TEExtraState, torch.nn.Module):
    """TE's GroupedLinear as Megatron's wrapper builds it for MoE experts: ``num_gemms`` local
    experts, each a ``weight{i}`` [out, in] (and ``bias{i}``), run as one grouped GEMM over the
    tokens permuted by expert (``forward(x, m_splits)``). Expert-tensor-parallel sizes are
    divided here and the layer itself communicates nothing: the token dispatcher does (as in
    Megatron's wrapper with explicit expert communication)."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name=None,
        tp_group=None,
        pg_collection=None,
        name=None,
        **_te_only: Any,
    ) -> None:
        if not is_expert:
            raise ValueError("TEGroupedLinear only supports expert parallelism (is_expert=True)")
        if parallel_mode not in ("column", "row", None):
            raise ValueError(f"TEGroupedLinear: unknown parallel_mode {parallel_mode!r}")
        super().__init__()
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker,
            get_expert_parallel_rng_tracker_name,
        )

        self.config = config
        self.num_gemms = num_gemms
        self.te_return_bias = skip_bias_add and bias
        self.use_bias = bias
        self._tp_group, tp_size, ep_size, self._ep_rank = _expert_groups(pg_collection, tp_group)
        self._ep_size = ep_size
        self._pg_collection = pg_collection
        if parallel_mode == "column":
            output_size = output_size // tp_size
        elif parallel_mode == "row":
            input_size = input_size // tp_size
        self.in_features, self.out_features = input_size, output_size
        device = "cpu" if config.use_cpu_initialization else _device()
        tracker = get_cuda_rng_tracker()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(
                torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
            )
            if config.perform_initialization:
                with tracker.fork(get_expert_parallel_rng_tracker_name()), torch.no_grad():
                    init_method(weight)
            self.register_parameter(f"weight{i}", weight)
        for i in range(num_gemms):
            self.register_parameter(
                f"bias{i}",
                torch.nn.Parameter(
                    torch.zeros(output_size, dtype=config.params_dtype, device=device)
                )
                if bias
                else None,
            )
        for param in self.parameters():
            param.allreduce = not (is_expert and ep_size > 1)
        self._register_load_state_dict_pre_hook(_merge_extra_states, with_module=True)

    def forward(self, x: torch.Tensor, m_splits):
        from megatron_npu.ops.grouped_matmul import grouped_mm

        splits = [int(m) for m in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
        shape = x.shape
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        out = grouped_mm(x.reshape(-1, shape[-1]), weights, splits, trans_b=True)
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        if self.use_bias and not self.te_return_bias:
            out = out + torch.repeat_interleave(
                torch.stack(biases), torch.tensor(splits, device=out.device), dim=0
            ).to(out.dtype)
        out = out.view(*shape[:-1], self.out_features)
        return (out, biases) if self.te_return_bias else (out, None)

    def _sharded_state_dict_grouped(
        self, tp_axis_map, prefix="", sharded_offsets=(), metadata=None
    ):
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        metadata = metadata or {}
        singleton = metadata.get("singleton_local_shards", False)
        full = self.state_dict(prefix="", keep_vars=True)
        num_global = self._ep_size * self.num_gemms
        offset = self._ep_rank * self.num_gemms
        ep_axis = len(sharded_offsets)
        group_kwargs = _accepted_function(
            make_sharded_tensors_for_checkpoint,
            dict(
                tp_group=self._tp_group,
                dp_cp_group=metadata.get("dp_cp_group"),
            ),
        )
        sharded: dict[str, Any] = {}
        for i in range(self.num_gemms):
            global_idx = offset + i
            state = {f"{i}.weight": full[f"weight{i}"], f"{i}._extra_state": full["_extra_state"]}
            if self.use_bias:
                state[f"{i}.bias"] = full[f"bias{i}"]
            if singleton:
                expert_prefix, offsets = f"{global_idx}.{prefix}", sharded_offsets
            else:
                expert_prefix = prefix
                offsets = (*sharded_offsets, (ep_axis, global_idx, num_global))
            sub = make_sharded_tensors_for_checkpoint(
                state, "", tp_axis_map, offsets, **group_kwargs
            )
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            sharded[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            sharded[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                sharded[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        if self._pg_collection is not None:
            edp_rank = self._pg_collection.expt_dp.rank()
        else:
            edp_rank = ps.get_expert_data_parallel_rank()
        for tensor in sharded.values():  # replicated along the expert-data-parallel ranks
            tensor.replica_id = (*tensor.replica_id[:2], edp_rank)
        return sharded


def _merge_extra_states(module, state_dict, prefix, *_args: Any) -> None:
    """A distributed checkpoint brings back ``_extra_state1`` ... (one per expert, all equal
    without fp8): the module keeps one ``_extra_state``, as TE's wrapper merges them."""
    for i in range(1, module.num_gemms):
        state_dict.pop(f"{prefix}_extra_state{i}", None)


def _accepted_function(function: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(function).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """Grouped FC1 of the experts: output features split over expert-TP (axis 0 of each weight,
    and of each bias)."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name=None,
        tp_group=None,
        pg_collection=None,
        name=None,
        **_te_only: Any,
    ) -> None:
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode="column",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_group=tp_group,
            pg_collection=pg_collection,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        axes = {}
        for i in range(self.num_gemms):
            axes.update({f"{i}.weight": 0, f"{i}.bias": 0})
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)


class TERowParallelGroupedLinear(TEGroupedLinear):
    """Grouped FC2 of the experts: input features split over expert-TP (axis 1 of each weight;
    the bias is whole)."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name=None,
        tp_group=None,
        pg_collection=None,
        name=None,
        **_te_only: Any,
    ) -> None:
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode="row",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_group=tp_group,
            pg_collection=pg_collection,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        axes = {f"{i}.weight": 1 for i in range(self.num_gemms)}
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)
