"""Locate on msprobe dumps: the first module or API whose error its inputs do not explain.

msprobe (``mindstudio-probe``, Ascend's precision tool) dumps every module (level ``L0``), API
(``L1``, its default) or module and API (``mix``) call of a step on GPU, NPU or CPU: a folder per
step and rank holding
``dump.json`` (one row per call, named ``Module.<path>.<Class>.forward.<n>``,
``Functional.<api>.<n>.forward``, their ``backward`` rows and ``parameters_grad`` rows), and with
the ``tensor`` task the tensors in ``dump_tensor_data/*.pt``. ``msprobe compare`` judges each row
on its own against fixed thresholds, so an error that a fused kernel adds is hidden among the
rows after it that merely inherit it, and a small one passes every row. Here each row is judged
by locate's input-explained rule (:class:`megatron_npu.locate.modules.Rule`): a row diverges when
its output error is above the tolerance and above what the error of its inputs explains.

* **Tensor dumps**: errors are the relative L2 error of each tensor (the parity harness's
  metric, :func:`megatron_npu.locate.modules.tensor_error`), a row's the largest of its tensors.
* **Statistics dumps** (task ``statistics``, no tensors): msprobe keeps each tensor's max, min,
  mean and norm. From them only a *lower bound* of the relative L2 error follows (``|dNorm|``,
  ``|dMax|``, ``|dMin|`` and ``sqrt(n) |dMean|``, each over the reference's norm). A row named on
  statistics is off by at least that much more than its inputs' statistics moved; a row not
  named is not shown to be clean (a permutation or a sign flip keeps every statistic), and the
  inputs' bound is a lower bound too, so a named row may still be explained by its inputs.
  Take a tensor dump of that step to decide.

Rows are matched by msprobe's own names, rank by rank (``rank<R>`` folders; a single-process
dump's ``proc<pid>`` folder stands for rank 0). The first divergent row is the earliest in the
dump's order -- msprobe writes a call when it returns, so a module's APIs come before the module
-- among the divergent rows none of whose descendants (``construct.json``) diverges; forward
rows first, then backward and parameter-gradient rows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_npu.formats.locate_msprobe import FILENAME, FORMAT
from megatron_npu.locate.modules import Rule, msprobe_metrics, rule_for, tensor_error

TENSOR_TASK, STATISTICS_TASK = "tensor", "statistics"
#: what ``megatron-npu locate --msprobe`` writes into ``--out`` (its model:
#: :class:`megatron_npu.formats.locate_msprobe.LocateMsprobeResult`)
RESULT_FILE, RESULT_FORMAT = FILENAME, FORMAT
PHASE_ORDER = {"forward": 0, "backward": 1, "parameters_grad": 1}
_MODULE_ROW = re.compile(
    r"^Module\.(?P<path>.+)\.(?P<cls>[^.]+)\.(?P<phase>forward|backward|parameters_grad)\.\d+$"
)
_API_ROW = re.compile(r"^(?P<api>[A-Za-z_]+\.[^.]+)\.\d+\.(?P<phase>forward|backward)$")


class MsprobeDumpError(ValueError):
    """A path that is not an msprobe dump, or two dumps that cannot be compared."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    stats: dict[str, float]
    file: Path | None  # the tensor's .pt (tensor task)

    def load(self) -> torch.Tensor:
        assert self.file is not None
        try:
            return torch.load(self.file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001  (torch.load raises many kinds on a bad file)
            raise MsprobeDumpError(f"{self.file}: not a readable tensor file ({exc})") from None


@dataclass
class Row:
    name: str
    phase: str  # forward | backward | parameters_grad
    kind: str  # module | api
    order: int
    depth: int
    inputs: dict[str, TensorInfo] = field(default_factory=dict)
    outputs: dict[str, TensorInfo] = field(default_factory=dict)


@dataclass
class RankDump:
    path: Path  # the folder holding dump.json
    task: str
    level: str
    rows: dict[str, Row]
    parents: dict[str, str | None]


def _tensors(value: Any, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(position, msprobe tensor record) pairs of one argument tree."""
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor" or ("shape" in value and "dtype" in value):
            yield prefix, value
            return
        for key in value:
            yield from _tensors(value[key], f"{prefix}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{i}")


def _info(record: dict[str, Any], data_dir: Path) -> TensorInfo:
    stats = {
        k: record[k]
        for k in ("Max", "Min", "Mean", "Norm")
        if isinstance(record.get(k), (int, float))
    }
    name = record.get("data_name")
    return TensorInfo(
        tuple(record.get("shape") or ()),
        str(record.get("dtype", "")),
        stats,
        data_dir / name if name else None,
    )


def match_key(name: str) -> str:
    """What pairs a row of one dump with the other's: a module row by its path, phase and call
    index without its class (``Module.decoder.layers.0.input_layernorm.forward.0``: a port may
    serve a module with another class, e.g. the adaptor's norm where a GPU ran apex's); an API
    row by its name."""
    module = _MODULE_ROW.match(name)
    if module is None:
        return name
    return f"Module.{module['path']}.{module['phase']}.{name.rsplit('.', 1)[1]}"


def _row(name: str, data: dict[str, Any], order: int, data_dir: Path) -> Row | None:
    module, api = _MODULE_ROW.match(name), _API_ROW.match(name)
    if module is None and api is None:
        return None
    match = module or api
    depth = module["path"].count(".") + 1 if module else 0
    row = Row(name, match["phase"], "module" if module else "api", order, depth)
    if row.phase == "parameters_grad":  # {param name: tensor}: what the backward produced
        sources = {"output": data}
    else:
        sources = {
            key: data.get(key)
            for key in ("input_args", "input_kwargs", "input", "output", "parameters")
        }
    for key, value in sources.items():
        target = row.outputs if key == "output" else row.inputs
        for position, record in _tensors(value, key):
            target[position] = _info(record, data_dir)
    return row


def _read_rank(dump_json: Path) -> RankDump:
    try:
        document = json.loads(dump_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MsprobeDumpError(
            f"{dump_json}: not readable as msprobe's dump.json ({exc})"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("data"), dict):
        raise MsprobeDumpError(f"{dump_json}: no 'data' table: not an msprobe dump.json")
    task = document.get("task")
    if task not in (TENSOR_TASK, STATISTICS_TASK):
        raise MsprobeDumpError(
            f"{dump_json}: task {task!r}; locate reads msprobe's 'tensor' and 'statistics' dumps"
        )
    data_dir = dump_json.parent / "dump_tensor_data"
    rows = {}
    for order, (name, data) in enumerate(document["data"].items()):
        row = _row(name, data if isinstance(data, dict) else {}, order, data_dir)
        if row is not None:
            rows[match_key(name)] = row
    if not rows:
        level = document.get("level")
        first = next(iter(document["data"]), None)
        raise MsprobeDumpError(
            f"{dump_json}: no module or API call to compare (level {level!r}, "
            + (f"first row {first!r}" if first else "no rows")
            + "): locate reads msprobe's levels L0, L1 and mix, whose rows are named "
            "Module.<path>.<Class>.<phase>.<n> and <Api>.<name>.<n>.<phase>"
        )
    parents: dict[str, str | None] = {}
    construct = dump_json.with_name("construct.json")
    if construct.is_file():
        try:
            parents = {k: v for k, v in json.loads(construct.read_text(encoding="utf-8")).items()}
        except ValueError:
            parents = {}
    return RankDump(dump_json.parent, task, str(document.get("level", "")), rows, parents)


def _rank_key(folder: Path) -> str:
    """``step<N>/rank<R>`` relative to the dump root (a ``proc<pid>`` folder is rank 0)."""
    parts = []
    for part in folder.parts:
        if re.fullmatch(r"step\d+", part):
            parts = [part]
        elif re.fullmatch(r"rank\d+", part):
            parts.append(part)
        elif re.fullmatch(r"proc\d+", part):
            parts.append("rank0")
    return "/".join(parts) or "rank0"


def read_dump(path: str | Path) -> dict[str, RankDump]:
    """Every rank's dump under ``path`` (a dump root, a ``step<N>`` or ``rank<R>`` folder, or a
    ``dump.json``), keyed ``step<N>/rank<R>``."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.rglob("dump.json"))
    else:
        raise MsprobeDumpError(f"{path}: no such file or folder")
    if not files:
        raise MsprobeDumpError(f"{path}: no dump.json under it: not an msprobe dump")
    dumps = {}
    for file in files:
        key = _rank_key(file.parent.resolve())
        if key in dumps:
            raise MsprobeDumpError(
                f"{path}: two dumps for {key} ({dumps[key].path}, {file.parent})"
            )
        dumps[key] = _read_rank(file)
    return dumps


def _rel(a: float, b: float, scale: float) -> float:
    if scale > 0:
        return abs(a - b) / scale
    return 0.0 if a == b else math.inf


def statistics_bound(cand: TensorInfo, ref: TensorInfo) -> float:
    """A lower bound of the relative L2 error of ``cand`` against ``ref`` from their statistics."""
    if cand.shape != ref.shape:
        return math.inf
    norm = ref.stats.get("Norm")
    if norm is None:
        return 0.0
    numel = math.prod(ref.shape) if ref.shape else 1
    bounds = [0.0]
    for key, weight in (("Norm", 1.0), ("Max", 1.0), ("Min", 1.0), ("Mean", math.sqrt(numel))):
        if key in cand.stats and key in ref.stats:
            c, r = cand.stats[key], ref.stats[key]
            if not (math.isfinite(c) and math.isfinite(r)):
                if not (math.isnan(c) and math.isnan(r)) and c != r:
                    return math.inf
                continue
            bounds.append(weight * _rel(c, r, norm))
    return max(bounds)


def _error(
    cand: dict[str, TensorInfo], ref: dict[str, TensorInfo], task: str
) -> tuple[float, str | None]:
    """The largest error over the tensors of one side of a row, and the tensor it is in."""
    worst, where = 0.0, None
    for position in sorted(set(cand) | set(ref)):
        if position not in cand or position not in ref:
            return math.inf, position
        if (
            task == TENSOR_TASK
            and cand[position].file is not None
            and ref[position].file is not None
        ):
            err = tensor_error(cand[position].load(), ref[position].load())
        else:
            err = statistics_bound(cand[position], ref[position])
        if err > worst or where is None:
            worst, where = err, position
    return worst, where


@dataclass
class RowVerdict:
    rank: str
    name: str
    phase: str
    kind: str
    depth: int
    output: float
    input: float
    tolerance: float
    diverges: bool
    worst: str | None

    module: str  # the row itself, or for an API the module it ran in

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "name": self.name,
            "module": self.module,
            "phase": self.phase,
            "kind": self.kind,
            "depth": self.depth,
            "output": self.output,
            "input": self.input,
            "tolerance": self.tolerance,
            "diverges": self.diverges,
            "worst": self.worst,
        }


def _check_comparable(reference: dict[str, RankDump], candidate: dict[str, RankDump]) -> None:
    """Two dumps of one model, step and task, with their tensor files; else one named error.

    API rows may differ (another device calls other APIs: ``NPU.npu_rms_norm`` on an NPU where a
    GPU calls ``Functional.rms_norm``); module rows may not: a module one side has and the
    other lacks, or a tensor of another shape, is another model."""
    ref_tasks = {d.task for d in reference.values()}
    cand_tasks = {d.task for d in candidate.values()}
    if ref_tasks != cand_tasks:
        raise MsprobeDumpError(
            f"the reference is a {'/'.join(sorted(ref_tasks))} dump and the candidate a "
            f"{'/'.join(sorted(cand_tasks))} dump: dump both with the same task (tensor, to "
            "decide; statistics give lower bounds only)"
        )
    for key in sorted(reference):
        ref, cand = reference[key].rows, candidate[key].rows
        modules = {k for k, r in ref.items() if r.kind == "module"}
        cand_modules = {k for k, r in cand.items() if r.kind == "module"}
        if modules != cand_modules:
            only = sorted(modules - cand_modules)[:1] or sorted(cand_modules - modules)[:1]
            side = "reference" if only[0] in modules else "candidate"
            raise MsprobeDumpError(
                f"{key}: the dumps are of other models: {only[0]} is only in the {side} "
                f"({len(modules ^ cand_modules)} module rows differ)"
            )
        for name in sorted(set(ref) & set(cand), key=lambda n: cand[n].order):
            for side_name in ("inputs", "outputs"):
                r_side, c_side = getattr(ref[name], side_name), getattr(cand[name], side_name)
                for position in sorted(set(r_side) & set(c_side)):
                    if r_side[position].shape != c_side[position].shape:
                        raise MsprobeDumpError(
                            f"{key}: the dumps are of other models: "
                            f"{cand[name].name} {position} has shape "
                            f"{list(r_side[position].shape)} in the reference and "
                            f"{list(c_side[position].shape)} in the candidate"
                        )
        if TENSOR_TASK in ref_tasks:
            for dump in (reference[key], candidate[key]):
                for row in dump.rows.values():
                    for info in (*row.inputs.values(), *row.outputs.values()):
                        if info.file is not None and not info.file.is_file():
                            raise MsprobeDumpError(
                                f"{info.file}: a tensor file its dump.json names is missing "
                                "(copy the whole dump folder, dump_tensor_data/ included)"
                            )


def compare(
    reference: dict[str, RankDump], candidate: dict[str, RankDump], rule: Rule | None = None
) -> dict[str, Any]:
    """Both dumps row by row with the input-explained rule; the first divergent row."""
    if set(reference) != set(candidate):
        raise MsprobeDumpError(
            f"the dumps hold other steps or ranks: reference {sorted(reference)}, candidate "
            f"{sorted(candidate)}"
        )
    _check_comparable(reference, candidate)
    tasks = {d.task for d in (*reference.values(), *candidate.values())}
    task = TENSOR_TASK if tasks == {TENSOR_TASK} else STATISTICS_TASK
    verdicts: list[RowVerdict] = []
    unmatched: dict[str, list[str]] = {}
    first = None
    for key in sorted(reference):
        ref, cand = reference[key], candidate[key]
        unmatched[key] = sorted(set(ref.rows) ^ set(cand.rows))
        dtype = next(
            (
                t.dtype.removeprefix("torch.")
                for r in cand.rows.values()
                for t in r.outputs.values()
            ),
            "float32",
        )
        active = rule or rule_for(dtype)
        backward_inputs = {}
        for name, row in cand.rows.items():
            if row.phase == "backward" and row.kind == "module":
                backward_inputs[name.rsplit(".backward.", 1)[0]] = name
        rows = []
        row_keys: dict[str, str] = {}  # the candidate's row name -> its match key
        for name in sorted(set(ref.rows) & set(cand.rows), key=lambda n: cand.rows[n].order):
            crow, rrow = cand.rows[name], ref.rows[name]
            c_in, r_in = crow.inputs, rrow.inputs
            if crow.phase == "parameters_grad":  # its input is the module's incoming gradient
                owner = backward_inputs.get(name.rsplit(".parameters_grad.", 1)[0])
                if owner and owner in ref.rows:
                    c_in, r_in = cand.rows[owner].inputs, ref.rows[owner].inputs
            out_err, worst = _error(crow.outputs, rrow.outputs, task)
            in_err, _ = _error(c_in, r_in, task)
            verdict = RowVerdict(
                key,
                crow.name,
                crow.phase,
                crow.kind,
                crow.depth,
                out_err,
                in_err,
                active.tolerance(crow.depth),
                active.diverges(out_err, in_err, crow.depth),
                worst,
                _enclosing_module(crow.name, cand.parents),
            )
            row_keys[crow.name] = name
            rows.append(verdict)
        verdicts += rows
        divergent = {v.name for v in rows if v.diverges}

        ranked = sorted(
            (
                v
                for v in rows
                if v.diverges and not _has_descendant_in(v.name, divergent, cand.parents)
            ),
            key=lambda v: (PHASE_ORDER[v.phase], cand.rows[row_keys[v.name]].order),
        )
        if ranked and first is None:
            first, first_key = ranked[0], row_keys[ranked[0].name]
    if first is not None:  # what a dump can say about the adaptor: the patches the row reaches
        first_row = first.as_dict()
        cand_row = candidate[first.rank].rows[first_key]
        ref_row = reference[first.rank].rows[first_key]
        worst = first.worst
        if (
            task == TENSOR_TASK
            and worst in cand_row.outputs
            and worst in ref_row.outputs
            and cand_row.outputs[worst].file is not None
        ):
            first_row["msprobe_metrics"] = msprobe_metrics(
                cand_row.outputs[worst].load(), ref_row.outputs[worst].load()
            )
        first_row["patches"] = patches_reaching(first.name)
        if first.module != first.name:
            first_row["module_patches"] = patches_reaching(first.module)
    statement = None
    if task == STATISTICS_TASK:
        statement = (
            "statistics only: every error is a lower bound of the relative L2 error, from the "
            "tensors' norm, max, min and mean; a named row is off by at least that much beyond "
            "its inputs' bound, but its inputs' true error may be larger, and a row not named is "
            "not shown to be clean (a permutation or a sign flip keeps every statistic); dump "
            "that step with task 'tensor' to decide"
        )
    return {
        "task": task,
        "levels": sorted({d.level for d in (*reference.values(), *candidate.values())}),
        "ranks": sorted(reference),
        "statement": statement,
        "divergent": first_row if first else None,
        "rows": [v.as_dict() for v in verdicts],
        "unmatched": {k: v for k, v in unmatched.items() if v},
    }


def patches_reaching(row_name: str) -> list[str]:
    """The adaptor patches a dump row reaches, by the registry: for a module row, the patches
    whose target is its class or a method of it (``...TENorm``, ``...DotProductAttention.forward``)
    or that build modules of its class (``builds``: the local spec's norm is megatron-npu's
    ``Norm``, built by ``norm.wrapped-torch-norm``);
    for an API row, the patches whose target is that function or that declare it as their
    torch_npu kernel (``NPU.npu_rms_norm``). Device plumbing (whole-module ``torch`` routing) is
    left out: it reaches everything."""
    from megatron_npu.registry import all_patches

    module = _MODULE_ROW.match(row_name)
    api = _API_ROW.match(row_name)
    if module is not None:
        name, kernel = module["cls"], None
    elif api is not None:
        name = kernel = api["api"].split(".", 1)[1]
    else:
        return []
    found = []
    for patch in all_patches():
        segments = patch.target.split(".")
        if (
            (name in segments[-2:] and not patch.target.endswith(".torch"))
            or (kernel is not None and kernel in (patch.npu_kernels or ()))
            or (kernel is None and name in {b.rsplit(".", 1)[-1] for b in patch.builds})
        ):
            found.append(patch.id)
    return sorted(found)


def _enclosing_module(name: str, parents: dict[str, str | None]) -> str:
    """``name`` if it is a module row, else its nearest ``Module.`` ancestor (or itself)."""
    current: str | None = name
    seen = set()
    while current and current not in seen:
        if current.startswith("Module."):
            return current
        seen.add(current)
        current = parents.get(current)
    return name


def _has_descendant_in(name: str, rows: set[str], parents: dict[str, str | None]) -> bool:
    return any(_is_ancestor(name, other, parents) for other in rows if other != name)


def _is_ancestor(ancestor: str, name: str, parents: dict[str, str | None]) -> bool:
    seen = set()
    parent = parents.get(name)
    while parent and parent not in seen:
        if parent == ancestor:
            return True
        seen.add(parent)
        parent = parents.get(parent)
    return False
