"""Hooks on every module of one rank's model for one training step, and the dump folder.

What is recorded (per call of each module, in the order it happens):

* ``forward.input`` -- every floating-point tensor the module is called with (args and kwargs)
* ``forward.output`` -- every floating-point tensor it returns (``(output, bias)`` tuples too)
* ``backward.grad_output`` -- the gradient that reaches the module's outputs
* ``backward.grad_input`` -- the gradient its backward sends to its inputs
* ``param.grad`` / ``param.update`` -- each parameter's gradient (``main_grad``) after the
  step's backward and its change by the optimizer step (pseudo-module ``optimizer``)

The backward quantities come from identity taps (an autograd function that clones its input and
records the gradient that flows back through it) put on the inputs by a forward pre-hook and on
the outputs by a forward hook, so each module's own share of a gradient is seen, not the sum over
every consumer of a tensor. The root module is named ``model`` (kind ``loss``: with labels it
returns the per-token loss).

Size limit: a tensor of at most ``limit`` elements is stored whole; a larger one as its
statistics plus a deterministic sample of ``limit`` elements (flat indices drawn by a generator
seeded with the element count, sorted: the same on both runs, so samples compare position by
position; random rather than strided, so a bug confined to some columns or heads is not stepped
over).

Dump folder (docs/locate.md): each rank folder is an msprobe dump (``mindstudio-probe``'s layout,
level ``L0``, task ``tensor``), so ``msprobe compare -tp CAND_DUMP -gp REF_DUMP`` and
``megatron-npu locate --msprobe`` read it as they read a dump msprobe made; locate's own index
sits beside it::

    <dump>/locate-dump.json     the replayed step, world, device, dtype, argv, disabled patches
                                 (:class:`megatron_npu.formats.locate_dump.DumpMeta`)
    <dump>/rank<R>/index.json   every tensor and the module table
                                 (:class:`megatron_npu.formats.locate_dump.DumpIndex`)
    <dump>/rank<R>/dump.json    msprobe's rows: ``Module.<name>.<Class>.forward.<call>``
                                 (``input_args``, ``output``), ``...backward.<call>`` (``input``:
                                 the gradient reaching the outputs, ``output``: the one sent to the
                                 inputs), ``...parameters_grad.0`` ({parameter: [gradient]})
    <dump>/rank<R>/construct.json  each row's parent row (msprobe's module tree)
    <dump>/rank<R>/stack.json   {} (no call stacks are recorded)
    <dump>/rank<R>/dump_tensor_data/<row>.<slot>.<i>.pt   one tensor per file (torch.save; read
                                 back with weights_only=True); a sampled tensor is stored as its
                                 sample, the same positions on both runs, while ``shape`` and the
                                 statistics describe the whole tensor

The parameters' updates (pseudo-module ``optimizer``) have no msprobe row: their files are
``optimizer.update.<parameter>.pt``, named by ``index.json`` only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_npu.files import write_private
from megatron_npu.formats import FormatError
from megatron_npu.formats.locate_dump import DUMP_FORMAT, DUMP_VERSION, DumpIndex, DumpMeta

#: the dump folder's own description (the rank folders hold msprobe's ``dump.json``)
META_FILE = "locate-dump.json"
#: each rank folder's index of its tensors and modules (:class:`DumpIndex`)
INDEX_FILE = "index.json"
TENSOR_DIR = "dump_tensor_data"
DEFAULT_LIMIT = 4096
ROOT = "model"
OPTIMIZER = "optimizer"

_KINDS = (
    (
        re.compile(
            r"(^|\.)(input_layernorm|pre_mlp_layernorm|final_layernorm|pre_cross_attn_layernorm"
            r"|q_layernorm|k_layernorm|layer_norm)$"
        ),
        "norm",
    ),
    (re.compile(r"(^|\.)core_attention$"), "attention"),
    (re.compile(r"(^|\.)self_attention$"), "attention"),
    (re.compile(r"(^|\.)scale_mask_softmax$"), "softmax"),
    (re.compile(r"(^|\.)rotary_pos_emb$"), "rotary"),
    (re.compile(r"(^|\.)(embedding|word_embeddings|position_embeddings)$"), "embedding"),
    (re.compile(r"(^|\.)output_layer$"), "output"),
    # mixture of experts: the router, the experts (each local expert, and the experts' linears:
    # TE's grouped FC1 / FC2, a local expert's) and the shared expert
    (re.compile(r"(^|\.)(router|experts|shared_experts|local_experts\.\d+)$"), "moe"),
    (re.compile(r"(^|\.)(experts|local_experts\.\d+)\.linear_\w+$"), "moe"),
    (re.compile(r"(^|\.)mlp$"), "mlp"),
    (re.compile(r"(^|\.)linear_\w+$"), "linear"),
    (re.compile(r"(^|\.)layers\.\d+$"), "layer"),
    (re.compile(r"(^|\.)decoder$"), "block"),
)


#: modules that compute nothing (Megatron's placeholders, containers that are never called)
_SKIPPED_CLASSES = frozenset({"IdentityOp", "IdentityFuncOp", "ModuleList", "ModuleDict"})


class DumpError(ValueError):
    """A dump folder is missing, unreadable or of another format."""


def module_kind(name: str) -> str:
    """``decoder.layers.0.input_layernorm`` -> ``norm``; the root is ``loss``."""
    if name == ROOT:
        return "loss"
    if name == OPTIMIZER:
        return "optimizer"
    for pattern, kind in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def module_depth(name: str, num_layers: int) -> int:
    """0 for the embedding, ``N + 1`` inside layer ``N``, ``num_layers + 1`` after the layers."""
    match = re.search(r"layers\.(\d+)", name)
    if match:
        return int(match.group(1)) + 1
    if name.startswith("embedding") or name == "rotary_pos_emb":
        return 0
    return num_layers + 1


def sample_indices(numel: int, limit: int) -> torch.Tensor | None:
    """The flat indices kept of a tensor with ``numel`` elements (None: all of them)."""
    if numel <= limit:
        return None
    generator = torch.Generator().manual_seed(numel)
    return torch.randperm(numel, generator=generator)[:limit].sort().values


def summarize(tensor: torch.Tensor, limit: int) -> tuple[dict[str, Any], torch.Tensor]:
    """(index fields, stored tensor): statistics of ``tensor`` and it or its sample."""
    t = tensor.detach()
    flat = t.reshape(-1)
    wide = flat.double()
    finite = wide[torch.isfinite(wide)]
    stats = {
        "numel": flat.numel(),
        "nonfinite": int(flat.numel() - finite.numel()),
        "mean": float(finite.mean()) if finite.numel() else None,
        "std": float(finite.std()) if finite.numel() > 1 else None,
        "min": float(finite.min()) if finite.numel() else None,
        "max": float(finite.max()) if finite.numel() else None,
        "l2": float(finite.norm()) if finite.numel() else None,
    }
    keep = sample_indices(flat.numel(), limit)
    stored = (flat if keep is None else flat[keep.to(flat.device)]).cpu().clone()
    fields = {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sampled": keep is not None,
        "stats": stats,
    }
    return fields, stored


class _Tap(torch.autograd.Function):
    """Identity (a clone) whose backward hands the incoming gradient to a callback."""

    @staticmethod
    def forward(ctx, x, callback):  # noqa: ANN001, ANN205
        ctx.callback = callback
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        ctx.callback(grad)
        return grad, None


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class Recorder:
    """Hooks on every module of ``chunks`` (unwrapped GPT models) for one step."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        tracer: Any = None,
        limit: int = DEFAULT_LIMIT,
        num_layers: int = 0,
    ) -> None:
        self.chunks = chunks
        self.tracer = tracer
        self.limit = limit
        self.num_layers = num_layers
        self.entries: list[dict[str, Any]] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.modules: dict[str, dict[str, Any]] = {}
        self._handles: list[Any] = []
        self._calls: dict[str, int] = {}
        self._by_name: dict[str, torch.nn.Module] = {}
        self._params_before: dict[str, torch.Tensor] = {}
        self._open: list[tuple[str, int]] = []  # the module calls now running, innermost last
        self.parents: dict[tuple[str, int], tuple[str, int] | None] = {}

    # -- naming
    def _named(self) -> list[tuple[str, torch.nn.Module]]:
        out = []
        for index, chunk in enumerate(self.chunks):
            prefix = f"chunk{index}." if len(self.chunks) > 1 else ""
            for name, module in chunk.named_modules():
                if type(module).__name__ in _SKIPPED_CLASSES:
                    continue
                out.append((prefix + (name or ROOT), module))
        return out

    def _record(self, module: str, quantity: str, call: int, i: int, tensor: torch.Tensor) -> None:
        key = f"{module}#{call}|{quantity}|{i}"
        fields, stored = summarize(tensor, self.limit)
        self.entries.append(
            {
                "key": key,
                "module": module,
                "call": call,
                "quantity": quantity,
                "index": i,
                "order": len(self.entries),
                **fields,
            }
        )
        self.tensors[key] = stored

    def _tap(self, value: Any, module: str, call: int, quantity: str, counter: list[int]) -> Any:
        if isinstance(value, torch.nn.Parameter):
            # a parameter handed in as an input (the output layer's tied embedding weight) stays
            # itself: Megatron's gradient-accumulation fusion adds its weight gradient to the
            # parameter's own main_grad; the gradient is recorded as its param.grad
            return value
        if _is_float(value) and value.requires_grad and torch.is_grad_enabled():
            i = counter[0]
            counter[0] += 1

            def callback(grad, module=module, call=call, i=i):
                if grad is not None:
                    self._record(module, quantity, call, i, grad)

            return _Tap.apply(value, callback)
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._tap(v, module, call, quantity, counter) for v in value)
        if isinstance(value, list):
            return [self._tap(v, module, call, quantity, counter) for v in value]
        return value

    def _floats(self, value: Any) -> list[torch.Tensor]:
        if _is_float(value):
            return [value]
        if isinstance(value, (tuple, list)):
            return [t for v in value for t in self._floats(v)]
        return []

    # -- hooks
    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            call = self._calls.get(name, -1) + 1
            self._calls[name] = call
            self.parents[(name, call)] = self._open[-1] if self._open else None
            self._open.append((name, call))
            for i, t in enumerate(self._floats(list(args) + list(kwargs.values()))):
                self._record(name, "forward.input", call, i, t)
            if self.tracer is not None:
                self.tracer.enter(name)
            counter = [0]
            new_args = self._tap(tuple(args), name, call, "backward.grad_input", counter)
            new_kwargs = {
                k: self._tap(v, name, call, "backward.grad_input", counter)
                for k, v in kwargs.items()
            }
            return new_args, new_kwargs

        return hook

    def _post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            call = self._calls.get(name, 0)
            if self._open and self._open[-1] == (name, call):
                self._open.pop()
            if self.tracer is not None:
                self.tracer.leave(name)
            for i, t in enumerate(self._floats(output)):
                self._record(name, "forward.output", call, i, t)
            return self._tap(output, name, call, "backward.grad_output", [0])

        return hook

    def __enter__(self) -> Recorder:
        for name, module in self._named():
            self._by_name[name] = module
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post_hook(name), with_kwargs=True)
            )
        for name, param in self._parameters():
            keep = sample_indices(param.numel(), self.limit)
            flat = param.detach().reshape(-1)
            self._params_before[name] = (flat if keep is None else flat[keep]).double().cpu()
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        out = []
        for index, chunk in enumerate(self.chunks):
            prefix = f"chunk{index}." if len(self.chunks) > 1 else ""
            out += [(prefix + name, p) for name, p in chunk.named_parameters()]
        return out

    def record_parameters(self) -> None:
        """After the step: each parameter's gradient and its update, under its owning module."""
        for name, param in self._parameters():
            owner = name.rpartition(".")[0] or ROOT
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                self._record(owner, f"param.grad:{name.rpartition('.')[2]}", 0, 0, grad)
            keep = sample_indices(param.numel(), self.limit)
            flat = param.detach().reshape(-1)
            after = (flat if keep is None else flat[keep]).double().cpu()
            update = after - self._params_before[name]
            key = f"{OPTIMIZER}#0|param.update:{name}|0"
            self.entries.append(
                {
                    "key": key,
                    "module": OPTIMIZER,
                    "call": 0,
                    "quantity": f"param.update:{name}",
                    "index": 0,
                    "order": len(self.entries),
                    "shape": list(param.shape),
                    "dtype": str(param.dtype).removeprefix("torch."),
                    "sampled": keep is not None,
                    "stats": {"numel": param.numel(), "l2": float(update.norm())},
                    "param_owner": owner,
                }
            )
            self.tensors[key] = update

    def module_table(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, module in self._by_name.items():
            out[name] = {
                "kind": module_kind(name),
                "class": type(module).__name__,
                "depth": module_depth(name, self.num_layers),
                "patches": self.tracer.reached(name, module) if self.tracer else {},
            }
        out[OPTIMIZER] = {
            "kind": "optimizer",
            "class": "optimizer",
            "depth": self.num_layers + 2,
            "patches": self.tracer.reached(OPTIMIZER) if self.tracer else {},
        }
        return out

    def write(self, dump_dir: str | Path, rank: int, coords: dict[str, int]) -> Path:
        folder = Path(dump_dir) / f"rank{rank}"
        (folder / TENSOR_DIR).mkdir(parents=True, exist_ok=True)
        table = self.module_table()
        classes = {name: info["class"] for name, info in table.items()}
        rows: dict[str, dict[str, Any]] = {}
        last: dict[str, int] = {}
        calls: dict[str, MsprobePlace] = {}
        for entry in self.entries:
            place = msprobe_place(entry, classes)
            entry["data_name"] = place.data_name
            torch.save(self.tensors[entry["key"]], folder / TENSOR_DIR / place.data_name)
            if place.row is None:
                continue
            row = rows.setdefault(place.row, {})
            last[place.row] = entry["order"]
            calls[place.row] = place
            slot = row.setdefault(place.slot, {} if place.slot == "parameters_grad" else [])
            tensor = _msprobe_tensor(entry, place.data_name)
            if isinstance(slot, dict):
                slot.setdefault(place.parameter, []).append(tensor)
            else:
                slot.append(tensor)
        data = {}
        for name in sorted(rows, key=last.__getitem__):  # msprobe writes a row when it returns
            row = rows[name]
            if ".parameters_grad." in name:
                data[name] = row.get("parameters_grad", {})
            elif ".forward." in name:
                data[name] = {
                    "input_args": row.get("input_args", []),
                    "input_kwargs": {},
                    "output": row.get("output", []),
                    "parameters": {},
                }
            else:
                data[name] = {"input": row.get("input", []), "output": row.get("output", [])}
        msprobe = {
            "task": "tensor",
            "level": "L0",
            "framework": "pytorch",
            "dump_data_dir": str((folder / TENSOR_DIR).resolve()),
            "data": data,
        }
        _write_json(folder / "dump.json", msprobe)
        _write_json(folder / "construct.json", self._construct(calls, classes))
        _write_json(folder / "stack.json", {})
        index = {
            "rank": rank,
            "coords": coords,
            "limit": self.limit,
            "entries": self.entries,
            "modules": table,
        }
        DumpIndex.parse(index, str(folder / INDEX_FILE)).write(folder / INDEX_FILE)
        return folder

    def _construct(
        self, calls: dict[str, MsprobePlace], classes: dict[str, str]
    ) -> dict[str, str | None]:
        """msprobe's module tree: each row's parent, the call of the module it ran inside (a
        parameter-gradient row has none)."""
        out: dict[str, str | None] = {}
        for name, place in calls.items():
            parent = (
                None
                if place.phase == "parameters_grad"
                else (self.parents.get((place.module, place.call)))
            )
            out[name] = (
                None
                if parent is None
                else msprobe_row(
                    parent[0], classes.get(parent[0], "Module"), place.phase, parent[1]
                )
            )
        return out


def msprobe_row(module: str, cls: str, phase: str, call: int) -> str:
    """msprobe's name of a module call's row: ``Module.<path>.<Class>.<phase>.<call>``."""
    return f"Module.{module}.{cls}.{phase}.{call}"


@dataclass(frozen=True)
class MsprobePlace:
    """Where one recorded tensor goes in an msprobe dump: its row (of ``module``'s call
    ``call`` in ``phase``), the slot in that row (``input_args``/``output`` of a forward row,
    ``input``/``output`` of a backward row, ``parameters_grad``), the parameter's name for a
    gradient, and its file's name."""

    row: str | None
    slot: str
    data_name: str
    parameter: str = ""
    module: str = ""
    phase: str = ""
    call: int = 0


#: locate's forward/backward quantities -> (msprobe phase, slot, file part)
_SLOTS = {
    "forward.input": ("forward", "input_args", "input"),
    "forward.output": ("forward", "output", "output"),
    "backward.grad_output": ("backward", "input", "input"),
    "backward.grad_input": ("backward", "output", "output"),
}


def msprobe_place(entry: dict[str, Any], classes: dict[str, str]) -> MsprobePlace:
    """The msprobe row, slot and file name of one index entry."""
    module, quantity, call, i = entry["module"], entry["quantity"], entry["call"], entry["index"]
    cls = classes.get(module, "Module")
    if quantity in _SLOTS:
        phase, slot, part = _SLOTS[quantity]
        row = msprobe_row(module, cls, phase, call)
        return MsprobePlace(row, slot, f"{row}.{part}.{i}.pt", "", module, phase, call)
    kind, _, parameter = quantity.partition(":")
    if kind == "param.grad":
        row = msprobe_row(module, cls, "parameters_grad", 0)
        return MsprobePlace(
            row, "parameters_grad", f"{row}.{parameter}.pt", parameter, module, "parameters_grad", 0
        )
    return MsprobePlace(None, "", f"{OPTIMIZER}.update.{parameter}.pt")


def _msprobe_tensor(entry: dict[str, Any], data_name: str) -> dict[str, Any]:
    stats = entry.get("stats", {})
    return {
        "type": "torch.Tensor",
        "dtype": f"torch.{entry['dtype']}",
        "shape": entry["shape"],
        "Max": stats.get("max"),
        "Min": stats.get("min"),
        "Mean": stats.get("mean"),
        "Norm": stats.get("l2"),
        "requires_grad": False,
        "data_name": data_name,
    }


def _write_json(path: Path, data: Any) -> None:
    write_private(path, json.dumps(data, indent=1) + "\n")


def write_meta(dump_dir: str | Path, **meta: Any) -> None:
    """Write ``<dump>/locate-dump.json`` (:class:`DumpMeta`) from its fields."""
    DumpMeta(format=DUMP_FORMAT, version=DUMP_VERSION, **meta).write(Path(dump_dir) / META_FILE)


def read_meta(dump_dir: str | Path) -> DumpMeta:
    """``<dump>/locate-dump.json``; :class:`DumpError` names a folder that is no locate dump, a
    file of another format or version, or the field that does not fit."""
    path = Path(dump_dir) / META_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DumpError(f"{dump_dir}: not a locate dump ({exc.strerror}: {path})") from None
    except ValueError as exc:
        raise DumpError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != DUMP_FORMAT:
        raise DumpError(f"{path}: not a {DUMP_FORMAT} file")
    if data.get("version") != DUMP_VERSION:
        raise DumpError(f"{path}: dump version {data.get('version')!r}, expected {DUMP_VERSION}")
    try:
        return DumpMeta.parse(data, str(path))
    except FormatError as exc:
        raise DumpError(str(exc)) from None


def read_rank(dump_dir: str | Path, rank: int) -> tuple[DumpIndex, dict[str, torch.Tensor]]:
    """One rank's index and its tensors by entry key (each ``torch.load(weights_only=True)``:
    no code is unpickled)."""
    folder = Path(dump_dir) / f"rank{rank}"
    try:
        index = DumpIndex.read(folder / INDEX_FILE)
    except FormatError as exc:
        raise DumpError(f"{exc.source}: unreadable rank dump ({exc.message})") from None
    tensors = {}
    try:
        for entry in index.entries:
            path = folder / TENSOR_DIR / entry.data_name
            tensor = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(tensor, torch.Tensor):
                raise DumpError(f"{path}: not a tensor")
            tensors[entry.key] = tensor
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise DumpError(f"{folder}: unreadable rank dump ({exc})") from None
    return index, tensors


def rank_count(meta: DumpMeta) -> int:
    return meta.world


def dump_exists(dump_dir: str | Path) -> bool:
    return os.path.isfile(Path(dump_dir) / META_FILE)
