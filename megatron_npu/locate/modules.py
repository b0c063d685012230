"""Module-by-module comparison of two dumps of the same step, and the input-explained rule.

Every recorded tensor of the candidate is measured against the reference's with the parity
harness's metrics (:func:`megatron_npu.parity.metrics.compare`, one implementation; the reference
upcast to float64, the rule dtype the candidate tensor's). A module's error in a phase is the
largest ``rel_l2`` over its tensors of that phase:

==========  ===========================================  ==========================================
phase       output error (what the module produced)       input error (what it was given)
==========  ===========================================  ==========================================
forward     ``forward.output``                             ``forward.input``
backward    ``backward.grad_input`` and its ``param.grad``  ``backward.grad_output``
update      its parameters' ``param.update``               its parameters' ``param.grad``, also
                                                           element by element (Adam scales
                                                           each element: :func:`elementwise_error`)
==========  ===========================================  ==========================================

The loss is the root module's own code (``model``, kind ``loss``): its forward input is the
output layer's output (the logits) and its backward output the gradient that reaches the logits.

The error a module inherits from its inputs is not its own. A module *diverges* in a phase when

    output_error > tolerance(depth)  and  output_error > gain * input_error + tolerance(depth)

with ``tolerance(depth) = base[dtype] * (1 + growth * depth)`` (the tolerance grows with depth:
rounding differences of two healthy paths accumulate layer by layer). The first divergent module
is the first that diverges, scanning the forward phase in the order the modules finished, then
the backward phase in the order their backward finished, then the updates in parameter order.

Tensor-parallel and pipeline ranks are compared shard by shard (the same rank of both dumps); a
module's row is named with its shard (``tp1``, ``pp0``) when the world has more than one rank,
and the module's error is the worst shard's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_npu.formats.locate_dump import Coords, DumpIndex, Entry, Patches
from megatron_npu.locate import dump as dump_mod

PHASES = ("forward", "backward", "update")

#: the base tolerance of a module's relative-L2 error at depth 0 is this many times the parity
#: harness's rel_l2 bound of the candidate's dtype (``megatron_npu.parity.metrics``: 64 u for fp32,
#: 8 u for fp16/bf16): 1.5e-5 fp32 (two healthy fp32 paths differ by about 1e-7 per module),
#: 1.6e-2 fp16, 6.3e-2 bf16
BASE_MULTIPLE = 4.0
#: per-layer growth of the tolerance
DEPTH_GROWTH = 0.5
#: how much a module may amplify the relative error of its inputs
GAIN = 10.0


@dataclass(frozen=True)
class Rule:
    base: float
    growth: float = DEPTH_GROWTH
    gain: float = GAIN

    def tolerance(self, depth: int) -> float:
        return self.base * (1.0 + self.growth * depth)

    def diverges(self, out_err: float, in_err: float, depth: int) -> bool:
        tol = self.tolerance(depth)
        return out_err > tol and out_err > self.gain * in_err + tol

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def base_tolerance(dtype: str) -> float:
    from megatron_npu.parity.metrics import dtype_config

    try:
        return BASE_MULTIPLE * dtype_config(dtype).rel_l2_bound
    except (ValueError, KeyError):
        return BASE_MULTIPLE * dtype_config("float32").rel_l2_bound


def rule_for(dtype: str, base: float | None = None) -> Rule:
    return Rule(base if base is not None else base_tolerance(dtype))


@dataclass
class PhaseError:
    output: float | None = None  # None: nothing recorded in this phase
    input: float = 0.0
    diverges: bool = False
    tolerance: float = 0.0
    order: float = math.inf
    worst: str | None = None  # the key of the tensor with the largest output error

    def as_dict(self) -> dict[str, Any]:
        return {
            "output": _json_float(self.output),
            "input": _json_float(self.input),
            "ratio": _json_float(_ratio(self.output, self.input)),
            "tolerance": self.tolerance,
            "diverges": self.diverges,
            "worst": self.worst,
        }


@dataclass
class ModuleRow:
    name: str  # shard-qualified when the world has more than one rank
    module: str
    rank: int
    shard: str
    kind: str
    depth: int
    patches: Patches = field(default_factory=Patches)
    phases: dict[str, PhaseError] = field(default_factory=dict)
    #: the relative error of each of its parameters' gradients (by parameter name)
    param_grads: dict[str, float] = field(default_factory=dict)
    #: the same gradients' error element by element (:func:`elementwise_error`), as an optimizer
    #: that scales each element by its own magnitude (Adam) carries it into the update
    param_grads_elementwise: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "rank": self.rank,
            "shard": self.shard,
            "kind": self.kind,
            "depth": self.depth,
            "patches": self.patches.model_dump(exclude_unset=True),
            **{phase: self.phases[phase].as_dict() for phase in PHASES if phase in self.phases},
        }


def _json_float(value: float | None) -> float | str | None:
    if value is None:
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity"
    return value


def _ratio(out: float | None, inp: float) -> float | None:
    if out is None:
        return None
    if inp <= 0:
        return math.inf if out > 0 else 0.0
    return out / inp


def elementwise_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """The root mean square, over the elements, of each element's relative error
    ``|a - r| / (|r| + eps * max|r|)`` (``eps``: the dtype's machine epsilon, so an element far
    below the tensor's largest counts with the rounding of that largest, not its own size).

    Adam divides each gradient element by its own running magnitude, so the update carries an
    element's *relative* error whatever its size. A gradient that is zero in exact arithmetic
    (a key bias's: softmax ignores a constant added to a row of scores) is rounding noise on
    both paths, with a relative error near 1 in each element, while the tensor's ``rel_l2``
    stays at rounding level; the update of two healthy paths then differs well beyond
    ``rel_l2`` of their gradients, and this is the error that explains it."""
    if tuple(actual.shape) != tuple(reference.shape):
        return math.inf
    if not actual.is_floating_point() or actual.numel() == 0:
        return 0.0 if torch.equal(actual, reference) else math.inf
    a, r = actual.double(), reference.double()
    if not (torch.isfinite(a).all() and torch.isfinite(r).all()):
        return math.inf
    floor = torch.finfo(actual.dtype).eps * float(r.abs().max())
    if floor == 0.0:
        return 0.0 if torch.equal(a, r) else math.inf
    return float(((a - r).abs() / (r.abs() + floor)).pow(2).mean().sqrt())


def tensor_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``rel_l2`` of ``actual`` against ``reference`` (:func:`megatron_npu.parity.metrics.compare`);
    a shape mismatch or a non-finite mismatch is an infinite error."""
    from megatron_npu.parity.metrics import compare

    if tuple(actual.shape) != tuple(reference.shape):
        return math.inf
    if not actual.is_floating_point():
        return 0.0 if torch.equal(actual, reference) else math.inf
    rule_dtype = actual.dtype if actual.dtype in (torch.float16, torch.bfloat16) else torch.float32
    result = compare(actual.to(rule_dtype), reference.double(), rule_dtype)
    if result.inf_nan_mismatch_count:
        return math.inf
    return float(result.rel_l2 or 0.0)


#: the row thresholds users hold an msprobe comparison to (cosine, max absolute error: the first
#: rules of msprobe's API accuracy checker; ``msprobe compare``'s own Result column weighs a row
#: against its inputs instead)
MSPROBE_COSINE, MSPROBE_MAX_ABS = 0.99, 1e-3


def msprobe_metrics(actual: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """The metrics ``msprobe compare`` shows for one tensor pair (cosine, max absolute and
    relative error; the parity harness's implementation of msprobe's definitions), and whether
    they pass the thresholds users hold a row to (:data:`MSPROBE_COSINE`,
    :data:`MSPROBE_MAX_ABS`), shown beside the rule's verdict."""
    from megatron_npu.parity.metrics import compare as measure

    rule = actual.dtype if actual.dtype in (torch.float16, torch.bfloat16) else torch.float32
    result = measure(actual.to(rule), reference.double(), rule)
    cosine, max_abs = result.cosine, result.max_abs_error
    return {
        "cosine": cosine,
        "max_abs_error": max_abs,
        "max_rel_error": result.max_rel_error,
        "passes_msprobe_thresholds": bool(
            cosine is not None
            and cosine > MSPROBE_COSINE
            and max_abs is not None
            and max_abs < MSPROBE_MAX_ABS
        ),
    }


def _shard(coords: Coords, world: int) -> str:
    if world <= 1:
        return ""
    shard = f"tp{coords.tp}.pp{coords.pp}.dp{coords.dp}"
    return f"{shard}.cp{coords.cp}" if coords.cp is not None else shard


def _phase_of(quantity: str) -> tuple[str, str] | None:
    """quantity -> (phase, "in" | "out")"""
    if quantity == "forward.output":
        return "forward", "out"
    if quantity == "forward.input":
        return "forward", "in"
    if quantity == "backward.grad_input" or quantity.startswith("param.grad:"):
        return "backward", "out"
    if quantity == "backward.grad_output":
        return "backward", "in"
    return None


def _needed(entry: Entry, only: set[str]) -> bool:
    """Entries outside ``only`` that a kept module's row still reads."""
    quantity = entry.quantity
    if quantity.startswith("param.update:"):
        return entry.param_owner in only
    if entry.module.rpartition(".")[2] == "output_layer":
        return any(m.rpartition(".")[2] == dump_mod.ROOT for m in only)
    return False


def compare_rank(
    ref_index: DumpIndex,
    ref_tensors: dict,
    cand_index: DumpIndex,
    cand_tensors: dict,
    rule: Rule,
    world: int,
    only: set[str] | None = None,
) -> list[ModuleRow]:
    """The module rows of one rank (see the module docstring)."""
    ref_entries = {e.key: e for e in ref_index.entries}
    rank = cand_index.rank
    shard = _shard(cand_index.coords, world)
    rows: dict[str, ModuleRow] = {}

    def row(module: str) -> ModuleRow:
        if module not in rows:
            info = cand_index.modules.get(module)
            rows[module] = ModuleRow(
                name=f"{module}@{shard}" if shard else module,
                module=module,
                rank=rank,
                shard=shard,
                kind=info.kind if info else dump_mod.module_kind(module),
                depth=info.depth if info else 0,
                patches=info.patches if info else Patches(),
            )
        return rows[module]

    for entry in cand_index.entries:
        key = entry.key
        quantity = entry.quantity
        if only is not None and entry.module not in only and not _needed(entry, only):
            continue
        ref = ref_entries.get(key)
        err = math.inf if ref is None else tensor_error(cand_tensors[key], ref_tensors[key])
        if quantity.startswith("param.update:"):
            param = quantity.partition(":")[2]
            owner = entry.param_owner or param.rpartition(".")[0] or dump_mod.ROOT
            phase = row(owner).phases.setdefault("update", PhaseError())
            phase.output = err if phase.output is None else max(phase.output, err)
            if phase.output == err:
                phase.worst = key
            phase.order = min(phase.order, entry.order)
            continue
        place = _phase_of(quantity)
        if place is None:
            continue
        phase_name, side = place
        _loss_share(row, entry, err)
        if quantity.startswith("param.grad:"):
            name = quantity.partition(":")[2]
            row(entry.module).param_grads[name] = err
            row(entry.module).param_grads_elementwise[name] = (
                math.inf if ref is None else elementwise_error(cand_tensors[key], ref_tensors[key])
            )
        target = row(entry.module).phases.setdefault(phase_name, PhaseError())
        if side == "in":
            target.input = max(target.input, err)
        else:
            target.output = err if target.output is None else max(target.output, err)
            if target.output == err:
                target.worst = key
            target.order = min(target.order, entry.order)
    # a module's update row is explained by its own parameters' gradients
    for r in rows.values():
        upd = r.phases.get("update")
        if upd is not None:
            upd.input = max(
                [upd.input, *r.param_grads.values(), *r.param_grads_elementwise.values()]
            )
        for phase in r.phases.values():
            phase.tolerance = rule.tolerance(r.depth)
            if phase.output is not None:
                phase.diverges = rule.diverges(phase.output, phase.input, r.depth)
    return list(rows.values())


def _loss_share(row, entry: Entry, err: float) -> None:
    """The loss is the root's own code: its input is the output layer's output (the logits) and
    its backward produces the gradient that reaches the output layer's output."""
    module, quantity = entry.module, entry.quantity
    if module.rpartition(".")[2] != "output_layer" or entry.index != 0:
        return
    prefix = module[: -len("output_layer")]
    root = row(prefix + dump_mod.ROOT)
    if quantity == "forward.output":
        phase = root.phases.setdefault("forward", PhaseError())
        phase.input = max(phase.input, err)
    elif quantity == "backward.grad_output":
        phase = root.phases.setdefault("backward", PhaseError())
        phase.output = err if phase.output is None else max(phase.output, err)
        if phase.output == err:
            phase.worst = entry.key
        phase.order = min(phase.order, entry.order)


@dataclass
class Comparison:
    rows: list[ModuleRow]
    first: tuple[ModuleRow, str] | None  # (row, phase)
    rule: Rule
    #: msprobe's metrics of the first divergent module's worst tensor, with its msprobe row
    first_msprobe: dict[str, Any] | None = None
    #: the candidate dump's dtype
    dtype: str = "float32"

    def gradient_bound(self, dtype: str | None = None) -> dict[str, Any]:
        """TTrace's gradient bound on this step (:mod:`.gradient_bound`): every parameter
        gradient's relative error against ``k * C**(L + 1 - l) * eps``, ``l`` its layer, for
        ``dtype`` (the candidate's unless given)."""
        from megatron_npu.locate import gradient_bound

        modules = [r for r in self.rows if r.module != dump_mod.OPTIMIZER]
        num_layers = max((r.depth for r in modules), default=1) - 1
        grads = [
            (f"{r.name}.{p}", r.depth, err) for r in modules for p, err in r.param_grads.items()
        ]
        return gradient_bound.judge(grads, num_layers, dtype or self.dtype)

    def first_dict(self) -> dict[str, Any] | None:
        if self.first is None:
            return None
        row, phase = self.first
        kind = "optimizer" if phase == "update" else row.kind  # the update is the optimizer's
        extra = {"msprobe": self.first_msprobe} if self.first_msprobe else {}
        return {
            "module": row.module,
            "name": row.name,
            "shard": row.shard,
            "rank": row.rank,
            "kind": kind,
            "module_kind": row.kind,
            "phase": phase,
            **row.phases[phase].as_dict(),
            **extra,
        }


def first_divergent(rows: list[ModuleRow]) -> tuple[ModuleRow, str] | None:
    for phase in PHASES:
        candidates = [r for r in rows if phase in r.phases and r.phases[phase].diverges]
        if candidates:
            best = min(candidates, key=lambda r: (r.phases[phase].order, r.rank))
            return best, phase
    return None


def compare_dumps(
    reference: str | Path,
    candidate: str | Path,
    rule: Rule | None = None,
    only: set[str] | None = None,
) -> Comparison:
    """Compare two dump folders rank by rank. ``only``: keep just these modules' rows."""
    ref_meta = dump_mod.read_meta(reference)
    cand_meta = dump_mod.read_meta(candidate)
    world = dump_mod.rank_count(cand_meta)
    if dump_mod.rank_count(ref_meta) != world:
        raise dump_mod.DumpError(
            f"the dumps have different worlds ({dump_mod.rank_count(ref_meta)} vs {world} ranks): "
            "replay both in the same layout"
        )
    if rule is None:
        rule = rule_for(cand_meta.dtype)
    rows: list[ModuleRow] = []
    worst: dict[tuple[int, str], dict[str, Any]] = {}  # (rank, key) -> the pair and its file
    for rank in range(world):
        ref_index, ref_tensors = dump_mod.read_rank(reference, rank)
        cand_index, cand_tensors = dump_mod.read_rank(candidate, rank)
        rank_rows = compare_rank(
            ref_index, ref_tensors, cand_index, cand_tensors, rule, world, only
        )
        rows += [r for r in rank_rows if only is None or r.module in only]
        names = {e.key: e.data_name for e in cand_index.entries}
        for r in rank_rows:  # the tensors a module may be named by, kept while they are loaded
            for phase in r.phases.values():
                key = phase.worst
                if key in ref_tensors and key in cand_tensors:
                    worst[(rank, key)] = {
                        "data_name": names[key],
                        "ref": ref_tensors[key],
                        "cand": cand_tensors[key],
                    }
    first = first_divergent(rows)
    dtype = cand_meta.dtype
    return Comparison(rows, first, rule, _first_msprobe(worst, first), dtype)


def _first_msprobe(
    worst: dict[tuple[int, str], dict[str, Any]], first: tuple[ModuleRow, str] | None
) -> dict[str, Any] | None:
    """msprobe's metrics of the tensor that gave the first divergent module its error, and the
    file (``dump_tensor_data/<name>``, the ``Data_name`` of msprobe compare's table) it is in."""
    if first is None:
        return None
    row, phase = first
    pair = worst.get((row.rank, row.phases[phase].worst or ""))
    if pair is None or pair["ref"].shape != pair["cand"].shape:
        return None
    return {"data_name": pair["data_name"], **msprobe_metrics(pair["cand"], pair["ref"])}
