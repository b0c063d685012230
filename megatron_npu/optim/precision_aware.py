"""Transformer Engine's precision-aware ``FusedAdam``, on the op layer's AdamW step.

Megatron's ``--use-precision-aware-optimizer`` keeps no fp32 main parameters of its own: the
distributed optimizer hands TE's ``FusedAdam`` the 16-bit shards of the model parameters with
these options (megatron-core's optimizer factory), and TE's optimizer keeps the rest:

* ``master_weights`` / ``master_weight_dtype``: a master copy in fp32 or fp16, state
  ``master_param``;
* ``store_param_remainders``: for bf16 parameters and an fp32 master, only the master's low
  16 bits (int16): the bf16 parameter is the master's high half, rounded half away from zero, so
  parameter and remainder give the fp32 master back exactly;
* ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: moments in fp32, bf16 or fp16;
* ``use_decoupled_grad``: gradients read from ``param.decoupled_grad`` (bf16 with
  ``--main-grads-dtype bf16``), since torch wants ``.grad`` in the parameter's dtype.

fp16 states carry one fp32 scale per tensor, ``absmax / (fp16 max / 2)``, and are stored divided
by it; bf16 states are stored rounded. Megatron reads and writes the states for checkpoints in
TE's units through :meth:`get_unscaled_state` / :meth:`set_scaled_state` (fp32; the int16
remainders as they are) and creates them with :meth:`initialize_state`. The step count stays
per parameter (``state["step"]``) as in ``torch.optim.AdamW``: Megatron's distributed optimizer
without TE reads it there.

Each step unscales the states to fp32 (a chunk of :data:`CHUNK_ELEMENTS` at a time, so the
temporaries stay bounded), runs one fp32 AdamW update per chunk through
:func:`megatron_npu.ops.adamw.adamw_step_` (``npu_apply_adam_w`` on the NPU, whose operands share
one dtype; ``torch._fused_adamw_`` natively), and stores master, moments and parameter back in
their dtypes. fp8 moments (``torch.uint8``) are TE ``Float8Tensor`` objects and are refused here
by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_npu.ops.adamw import adamw_step_, element_chunks
from megatron_npu.optim.adamw import FusedAdamW, hyperparameters

_STATES = ("exp_avg", "exp_avg_sq", "master_param")
_STORED = (torch.float32, torch.bfloat16, torch.float16)
#: the magnitude an fp16 state is scaled to: half of fp16's largest value, as TE scales it
_FP16_RANGE = torch.finfo(torch.float16).max / 2.0
#: the most elements one fp32 update covers: the states of a chunk are unscaled to fp32 for the
#: update, so this bounds the step's temporary memory (a larger tensor is a chunk of its own)
CHUNK_ELEMENTS = 1 << 24


def _halves(t: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 tensor's words as (low, high) int16 pairs, last dimension 2: the low
    half first, as every host and accelerator torch runs on lays them out (little-endian)."""
    return t.view(torch.int16).view(*t.shape, 2)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous fp32 master as (bf16 parameter, int16 remainder): the high 16 bits rounded
    half away from zero (up when the low half's top bit is set, i.e. the remainder is negative)
    and the low 16 bits. Two int16 passes, no conversions."""
    halves = _halves(master)
    remainder = halves[..., 0].clone()
    high = halves[..., 1] + (remainder < 0)
    return high.view(torch.bfloat16), remainder


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that :func:`split_master` split into ``param`` (bf16) and
    ``remainder`` (int16)."""
    words = torch.empty(*param.shape, 2, dtype=torch.int16, device=param.device)
    words[..., 0] = remainder
    torch.sub(param.view(torch.int16), (remainder < 0).to(torch.int16), out=words[..., 1])
    return words.view(torch.float32).view(param.shape)


def _remainders_of(value: torch.Tensor) -> torch.Tensor:
    """int16 remainders as a checkpoint hands them back: as they are, or cast to a float dtype
    (Megatron's ``fully_reshardable`` optimizer format holds every state as fp32, which keeps
    int16 values exactly)."""
    if value.dtype == torch.int16:
        return value
    exact = value.is_floating_point() and bool(
        torch.all((value == value.round()) & (value.abs() <= 2**15))
    )
    if not exact:
        raise TypeError(
            "precision-aware AdamW: a bf16 parameter's master is stored as int16 remainders, "
            f"got {value.dtype} values that are not int16 values"
        )
    return value.to(torch.int16)


class PrecisionAwareAdamW(FusedAdamW):
    """AdamW with TE ``FusedAdam``'s precision-aware options and state interface; a
    ``torch.optim.AdamW`` for every isinstance test. Megatron's factory reaches it through
    :class:`MegatronAdam`."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("precision-aware AdamW: amsgrad is not part of TE's FusedAdam")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise ValueError(
                f"precision-aware AdamW: master weights in {master_weight_dtype}; TE's FusedAdam "
                "keeps them in fp32 or fp16"
            )
        for name, dtype in (
            ("exp_avg_dtype", exp_avg_dtype),
            ("exp_avg_sq_dtype", exp_avg_sq_dtype),
        ):
            if dtype not in _STORED:
                raise ValueError(
                    f"precision-aware AdamW: {name}={dtype}: moments are served in fp32, bf16 or "
                    "fp16 (fp8 moments are Transformer Engine Float8Tensor objects)"
                )
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable
        )
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.dtypes = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ the states, TE's units

    def _remainders(self, param: torch.Tensor, name: str) -> bool:
        return (
            name == "master_param" and self.store_param_remainders and param.dtype == torch.bfloat16
        )

    def _scale(self, param: torch.Tensor, name: str) -> torch.Tensor:
        scales = self._scales.setdefault(param, {})
        if name not in scales:
            scales[name] = torch.ones(1, dtype=torch.float32, device=param.device)
        return scales[name]

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The state in fp32 (the stored tensor itself when it is fp32); the int16 remainders
        of a bf16 parameter's master as they are; ``step`` as it is."""
        stored = self.state[param][state_name]
        if state_name == "step" or self._remainders(param, state_name):
            return stored
        if stored.dtype == torch.float16:
            return stored.float().mul_(self._scale(param, state_name))
        return stored if stored.dtype == torch.float32 else stored.float()

    def set_scaled_state(
        self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor
    ) -> None:
        """Store ``unscaled_state`` (fp32, or int16 remainders) as the state's dtype keeps it:
        rounded to bf16, or divided by a fresh per-tensor scale into fp16."""
        state = self.state[param]
        if state_name == "step":  # a copy: each parameter advances its own
            state["step"] = unscaled_state.detach().clone()
            return
        if state_name not in state:
            self._initialize_state(param, state_name, zero=False)
        stored = state[state_name]
        if self._remainders(param, state_name):
            stored.copy_(_remainders_of(unscaled_state))
            return
        unscaled = unscaled_state.to(device=stored.device, dtype=torch.float32)
        if stored.dtype == torch.float16:
            scale = self._scale(param, state_name)
            absmax = unscaled.abs().amax() if unscaled.numel() else unscaled.new_zeros(())
            scale.copy_(absmax.reshape(1) / _FP16_RANGE)
            inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
            stored.copy_(unscaled * inverse)
        else:
            stored.copy_(unscaled)

    def _initialize_state(self, param: torch.Tensor, name: str, *, zero: bool) -> None:
        dtype = torch.int16 if self._remainders(param, name) else self.dtypes[name]
        data = torch.empty_like(param, dtype=dtype)
        if zero or dtype == torch.int16:
            data.zero_()
        self.state[param][name] = data
        if dtype == torch.float16:
            self._scale(param, name).fill_(1.0)

    def initialize_state(
        self, param: torch.Tensor, store_param_remainders: bool | None = None
    ) -> None:
        """Zero moments, step 0, and the master (when kept) from the parameter: exact for a
        bf16 parameter, whose remainders start at zero."""
        if store_param_remainders is not None and store_param_remainders != self._remainders(
            param, "master_param"
        ):
            raise ValueError(
                "precision-aware AdamW: store_param_remainders differs from the optimizer's own"
            )
        state = self.state[param]
        state["step"] = torch.tensor(0.0)
        self._initialize_state(param, "exp_avg", zero=True)
        self._initialize_state(param, "exp_avg_sq", zero=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero=False)
            if not self._remainders(param, "master_param"):
                self.set_scaled_state(param, "master_param", param.detach().float())

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with every state in TE's units (fp32; remainders int16)."""
        state_dict = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in state_dict["state"].items():
            param = params[index]
            state_dict["state"][index] = {
                name: self.get_unscaled_state(param, name) for name in entry
            }
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then every state stored again from the given values (torch casts
        them to the parameter's dtype on the way)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in state_dict["state"].items():
            param = params[index]
            self.state[param] = {}
            self._scales.pop(param, None)
            for name, value in entry.items():
                if value is None:
                    continue
                if name == "step":
                    self.state[param]["step"] = value.detach().clone().float().cpu()
                elif self._remainders(param, name):
                    self.set_scaled_state(param, name, value)
                else:
                    self.set_scaled_state(param, name, value.float())

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    # ------------------------------------------------------------------ the update

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        if self.use_decoupled_grad:
            return getattr(param, "decoupled_grad", None)
        return param.grad

    def _fp32(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The state as the fp32 tensor the update writes: the state itself when fp32."""
        if self._remainders(param, name):
            return join_master(param.detach(), self.state[param][name])
        return self.get_unscaled_state(param, name)

    def _step_group(self, group: dict[str, Any]) -> None:
        by_step: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in group["params"]:
            grad = self._grad(p)
            if grad is None and getattr(p, "decoupled_grad", None) is not None:
                raise RuntimeError(
                    "precision-aware AdamW: the gradients arrive in decoupled_grad, but the "
                    "optimizer was built to read .grad (megatron-core 0.13 passes "
                    "use_decoupled_grad only with --fp8-recipe delayed, Megatron-LM's default): "
                    "no parameter would be updated"
                )
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("precision-aware AdamW does not support sparse gradients")
            if len(self.state[p]) == 0:
                self.initialize_state(p)
            self.state[p]["step"] += 1
            by_step.setdefault(int(self.state[p]["step"].item()), []).append((p, grad))
        for step, pairs in by_step.items():
            params = [p for p, _ in pairs]
            for chunk in element_chunks(list(range(len(pairs))), params, CHUNK_ELEMENTS):
                self._update(group, step, [pairs[i] for i in chunk])

    def _update(
        self, group: dict[str, Any], step: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """One fp32 AdamW update of ``pairs`` (param, grad) at ``step``, stored back."""
        works = []
        for p, grad in pairs:
            state = self.state[p]
            work = {name: self._fp32(p, name) for name in _STATES if name in state}
            if "master_param" not in work:
                work["master_param"] = p.detach() if p.dtype == torch.float32 else p.float()
            work["grad"] = grad if grad.dtype == torch.float32 else grad.float()
            works.append(work)
        adamw_step_(
            [w["master_param"] for w in works],
            [w["grad"] for w in works],
            [w["exp_avg"] for w in works],
            [w["exp_avg_sq"] for w in works],
            step=step,
            **hyperparameters(group),
        )
        for (p, _), work in zip(pairs, works, strict=True):
            self._store(p, work)

    def _store(self, param: torch.Tensor, work: dict[str, torch.Tensor]) -> None:
        """The updated fp32 master, moments and parameter back into their dtypes."""
        state = self.state[param]
        for name in ("exp_avg", "exp_avg_sq"):
            if state[name] is not work[name]:
                self.set_scaled_state(param, name, work[name])
        master = work["master_param"]
        if self._remainders(param, "master_param"):
            high, remainder = split_master(master)
            state["master_param"].copy_(remainder)
            param.detach().copy_(high)
            return
        if "master_param" in state and state["master_param"] is not master:
            self.set_scaled_state(param, "master_param", master)
        if master.data_ptr() != param.data_ptr():
            param.detach().copy_(master)


#: Transformer Engine ``FusedAdam`` options megatron-core's factory passes with
#: ``--use-precision-aware-optimizer``
PRECISION_AWARE_OPTIONS = (
    "master_weights",
    "master_weight_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "use_decoupled_grad",
    "store_param_remainders",
)


class MegatronAdam(FusedAdamW):
    """The Adam megatron-core's optimizer factory builds: a :class:`FusedAdamW`, or, given any
    of TE's precision-aware options (:data:`PRECISION_AWARE_OPTIONS`), a
    :class:`PrecisionAwareAdamW`. Construction returns one of those two, built."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FusedAdamW:  # type: ignore[misc]
        if any(name in kwargs for name in PRECISION_AWARE_OPTIONS):
            return PrecisionAwareAdamW(*args, **kwargs)
        return FusedAdamW(*args, **kwargs)
