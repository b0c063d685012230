"""A comparison matrix: TOML (stdlib ``tomllib``) into typed dataclasses.

```toml
[compare]                      # all optional
baseline = "ref-fp32"          # default: the first [[run]]
timeout_s = 900                # per run; a run past it is killed and reported failed
lambada = true                 # evaluate each run's final checkpoint on LAMBADA (zero-shot cloze)
lambada_data = "default"       # or a lambada_test.jsonl-format file
vary = []                      # fingerprint fields this matrix may vary (e.g. ["seed"])
align_vocab = true             # pad every run's vocabulary to the same size (see below)
rtol = 0.02                    # approximate: every step's loss within this relative error
                               # (MindSpeed-LLM's CI: 2 % per step)
mean_rtol = 0.01               # approximate: mean relative error below this (Huawei's porting
                               # guide: above 1 % is "not aligned")
late_window = 10               # approximate: steps in the late-divergence window
late_growth = 0.01             # approximate: error growth over that window that flags a drift
grad_norm_rtol = 0.10          # approximate: every step's grad norm within this (MindSpeed-LLM)
layout_tol = 1e-5              # layout: per-step relative loss difference for fp32 layouts
perf_threshold = 0.05          # performance: slower than the baseline by more than this flags
                               # (MindSpeed-LLM's CI: step time within 5 %)
memory_threshold = 0.10        # performance: peak memory above the baseline's by more than this
                               # flags (MindSpeed-LLM's CI: memory within 10 %)
warmup_steps = 2               # performance: steps left out of the s/step statistics
noise_factor = 3.0             # noise: the rounding band is this times the reruns' envelope
noise_floor = 1e-6             # noise: the least relative difference the band ever holds

[defaults]                     # train options of every run (Megatron's names, without "--");
                               # each train run's are checked by train's own parser when the
                               # matrix is read: a bad one is an error naming the run
num-layers = 2
bf16 = false                   # true -> "--bf16"; false/absent -> left out

[[run]]
name = "ref-fp32"
device = "cpu"                 # or a list: the first one available here, e.g.
                               # ["npu", "npu-emulated"]
options = { }                  # this run's train options, over [defaults]
reference = "ref-fp32"         # what its verdict compares against (default: the baseline);
                               # false: a reference row only (no accuracy verdict of its own)
rerun_of = "ref-fp32"          # the same configuration again: the deterministic rule
perturb = "init-ulp"           # with rerun_of: a rounding-level rerun instead (init-ulp,
                               # init-ulp-down: initial weights one ulp up/down; threads: another
                               # host thread count; seed: the next seed, for scale only); two
                               # rounding reruns give rerun_of's candidates the noise rule
                               # (compare/noise.py)
optional = true                # skipped (and said so) when none of its devices is here
timeout_s = 300                # this run's own limit
speed_reference = "ref-fp32"   # time it against this run, like for like or not (default: its
                               # reference, judged like for like only: see rules.speed_mismatch)
hardware = "8x H200"           # a label for Table 2 (default: the device)

[[run]]                        # an imported run: results from another machine, not trained here
name = "gpu-8p"
import = "logs/gpu-8p.log"     # a Megatron-LM log, a TensorBoard event folder, or a megatron-npu
device = "cuda"                # metrics.json / compare results.json (+ run = "NAME" for the
hardware = "8x H200"           # latter); relative paths are relative to the matrix file; a log's
                               # MFU reads against the datasheet peak of the GPU this names
                               # (compare/datasheet.py)

[[run]]                        # a user's Megatron-LM script, run through the adaptor
name = "mlm-script"
script = "Megatron-LM/pretrain_gpt.py"   # relative to the matrix file
args = ["--num-layers", "2", "..."]      # the script's own arguments
nproc_per_node = 1
device = "npu-emulated"
```

``align_vocab``: Megatron pads the vocabulary to a multiple of ``make-vocab-size-divisible-by x
TP``, so a TP1 and a TP2 run of the same flags are *different models*. With ``align_vocab`` each
run's divisible-by becomes ``lcm(divisible-by_i x TP_i) / TP_i`` over all runs, so all pad alike;
without it the fingerprint rule refuses such a pair (naming ``padded_vocab_size``).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from megatron_npu.compare import noise, rules
from megatron_npu.devices.facts import DEVICES

DEFAULT_MATRIX = Path(__file__).with_name("default_matrix.toml")
#: Options a matrix run may not set: compare sets them per run.
RESERVED_OPTIONS = frozenset({"device", "metrics-out", "progress", "save", "load"})
#: Options that choose a layout (the layout rule applies when only these differ, in fp32).
LAYOUT_OPTIONS = frozenset(
    {
        "nproc-per-node",
        "tensor-model-parallel-size",
        "pipeline-model-parallel-size",
        "num-layers-per-virtual-pipeline-stage",
        "expert-model-parallel-size",
        "expert-tensor-parallel-size",
        "context-parallel-size",
        "cp-comm-type",
        "sequence-parallel",
        "use-distributed-optimizer",
        "overlap-grad-reduce",
        "overlap-param-gather",
        "make-vocab-size-divisible-by",
    }
)
DEFAULT_DIVISIBLE_BY = 128


class MatrixError(ValueError):
    """A matrix file that cannot be used; the message names what is wrong."""


@dataclass(frozen=True)
class Settings:
    baseline: str
    timeout_s: float = 900.0
    lambada: bool = False
    lambada_data: str = "default"
    vary: tuple[str, ...] = ()
    align_vocab: bool = True
    rtol: float = rules.RTOL
    mean_rtol: float = rules.MEAN_RTOL
    late_window: int = rules.LATE_WINDOW
    late_growth: float = rules.LATE_GROWTH
    grad_norm_rtol: float = rules.GRAD_NORM_RTOL
    layout_tol: float = 1e-5
    perf_threshold: float = rules.PERF_THRESHOLD
    memory_threshold: float = rules.MEMORY_THRESHOLD
    warmup_steps: int = 2
    noise_factor: float = noise.FACTOR
    noise_floor: float = noise.FLOOR


@dataclass(frozen=True)
class RunSpec:
    name: str
    devices: tuple[str, ...]  # candidates in order; the first available one runs
    options: dict[str, Any]
    reference: str | None = None  # None for the baseline and reference-only rows
    judged: bool = False  # has an accuracy verdict against ``reference``
    rerun_of: str | None = None
    optional: bool = False
    timeout_s: float | None = None  # overrides [compare] timeout_s
    speed_reference: str | None = None  # an explicitly named speed pair
    hardware: str | None = None  # Table 2's hardware label
    kind: str = "train"  # train | import | script
    path: str | None = None  # import: the file or folder; script: the script
    import_run: str | None = None  # import of a compare results.json: which of its runs
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    perturb: str | None = None  # a rounding or seed rerun of ``rerun_of`` (compare/noise.py)

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)

    @property
    def tensor_parallel(self) -> int:
        return int(self.options.get("tensor-model-parallel-size", 1))


@dataclass(frozen=True)
class Matrix:
    source: str  # the path, or "default"
    settings: Settings
    runs: tuple[RunSpec, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    def run(self, name: str) -> RunSpec:
        for spec in self.runs:
            if spec.name == name:
                return spec
        raise KeyError(name)


def option_argv(options: dict[str, Any]) -> list[str]:
    """``{"num-layers": 2, "bf16": True, "data-path": ["a", "b"]}`` -> train's argv."""
    argv: list[str] = []
    for key, value in options.items():
        flag = f"--{key}"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise MatrixError(f"{where}: [{key}] must be a table")
    return value


def _check_options(options: dict, where: str) -> dict[str, Any]:
    out = {}
    for key, value in options.items():
        key = str(key).removeprefix("--")
        if key in RESERVED_OPTIONS:
            raise MatrixError(f"{where}: option {key!r} is set by compare itself; leave it out")
        if isinstance(value, dict):
            raise MatrixError(f"{where}: option {key!r} must be a value or a list, not a table")
        out[key] = value
    return out


def _check_train_options(spec: RunSpec, where: str) -> None:
    """The run's options as ``megatron-npu train`` will read them: train's own parser and its
    checks, the world-size rules included, when the matrix is read -- so a misspelt or
    inconsistent option is one named error before any run starts, not a failed run later."""
    from megatron_npu.training import arguments
    from megatron_npu.training.options import TrainOptions

    try:
        options = TrainOptions.parse(option_argv(spec.options))
        arguments.finalize(options.args, options.world_size)  # its world-size rules
    except arguments.ArgumentError as exc:
        raise MatrixError(f"{where}: its train options: {exc}") from None


def _devices(value: Any, where: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else ()
    if not names:
        raise MatrixError(f"{where}: device must be a name or a list of names")
    unknown = [n for n in names if n not in DEVICES]
    if unknown:
        raise MatrixError(f"{where}: unknown device(s) {unknown}: choose from {sorted(DEVICES)}")
    return names


#: each [compare] key's type, read off :class:`Settings` (``baseline`` and ``vary`` apart)
_SETTING_TYPES = {
    f.name: {"float": float, "int": int, "bool": bool, "str": str}[f.type]
    for f in fields(Settings)
    if f.name not in ("baseline", "vary")
}


def _settings(raw: dict, runs: list[dict], where: str) -> Settings:
    known = set(_SETTING_TYPES) | {"baseline", "vary"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise MatrixError(f"{where}: unknown [compare] key(s) {unknown}: known are {sorted(known)}")
    values: dict[str, Any] = {}
    for key, kind in _SETTING_TYPES.items():
        if key in raw:
            value = raw[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise MatrixError(
                    f"{where}: [compare] {key} must be {kind.__name__}, got {value!r}"
                )
            values[key] = value
    vary = raw.get("vary", [])
    if not isinstance(vary, list) or not all(isinstance(v, str) for v in vary):
        raise MatrixError(f"{where}: [compare] vary must be a list of fingerprint field names")
    from megatron_npu.compare.fingerprint import FIELDS

    bad = sorted(set(vary) - set(FIELDS))
    if bad:
        raise MatrixError(
            f"{where}: [compare] vary names unknown fingerprint field(s) {bad}: "
            f"known are {list(FIELDS)}"
        )
    baseline = raw.get("baseline", runs[0].get("name") if runs else None)
    return Settings(baseline=str(baseline), vary=tuple(vary), **values)


def parse(data: dict, source: str, base_dir: Path | None = None) -> Matrix:
    """Build a :class:`Matrix` from parsed TOML ``data`` (``source`` names it in errors;
    ``base_dir``: where relative import/script paths start, default the working folder)."""
    base_dir = base_dir if base_dir is not None else Path.cwd()
    raw_runs = data.get("run", [])
    if not isinstance(raw_runs, list) or not raw_runs:
        raise MatrixError(f"{source}: no [[run]] entries")
    unknown_tables = sorted(set(data) - {"compare", "defaults", "run"})
    if unknown_tables:
        raise MatrixError(
            f"{source}: unknown top-level key(s) {unknown_tables}: "
            "use [compare], [defaults], [[run]]"
        )
    settings = _settings(_table(data, "compare", source), raw_runs, source)
    defaults = _check_options(_table(data, "defaults", source), f"{source} [defaults]")
    runs: list[RunSpec] = []
    names: set[str] = set()
    for index, raw in enumerate(raw_runs):
        where = f"{source} [[run]] #{index + 1}"
        if not isinstance(raw, dict):
            raise MatrixError(f"{where}: must be a table")
        name = raw.get("name")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise MatrixError(f"{where}: needs a name (a plain folder name), got {name!r}")
        where = f"{source} run {name!r}"
        if name in names:
            raise MatrixError(f"{where}: the name is used twice")
        names.add(name)
        extra = sorted(set(raw) - RUN_KEYS)
        if extra:
            raise MatrixError(f"{where}: unknown key(s) {extra}")
        rerun_of = raw.get("rerun_of")
        kind, path, extras = _source(raw, base_dir, where)
        options = {**defaults, **_check_options(raw.get("options", {}), where)}
        if kind == "import":
            options = {}
        if kind == "import" and "device" not in raw:
            devices: tuple[str, ...] = ()  # the imported file says which device ran it
        else:
            devices = _devices(raw.get("device", "cpu"), where)
        perturb = raw.get("perturb")
        if rerun_of is not None:
            original = next((r for r in runs if r.name == rerun_of), None)
            if original is None:
                raise MatrixError(f"{where}: rerun_of {rerun_of!r} must name an earlier run")
            if original.kind == "import":
                raise MatrixError(
                    f"{where}: rerun_of {rerun_of!r} names an imported run, which was not run "
                    "here and cannot be rerun"
                )
            if original.perturb is not None:
                raise MatrixError(
                    f"{where}: rerun_of {rerun_of!r} names a perturbed rerun: rerun its "
                    f"original, {original.rerun_of!r}"
                )
            options, devices = dict(original.options), original.devices
            kind, path = original.kind, original.path
            if kind == "script":
                extras = {
                    "script_args": original.script_args,
                    "nproc_per_node": original.nproc_per_node,
                }
            if perturb is not None:
                options, extras = _perturbed(original, perturb, where, extras)
        elif perturb is not None:
            raise MatrixError(f"{where}: perturb needs rerun_of = the run it perturbs")
        if perturb is not None and "reference" in raw:
            raise MatrixError(
                f"{where}: a perturbed rerun measures its run's noise; it takes no reference"
            )
        reference = raw.get("reference", rerun_of or settings.baseline)
        if reference is False:
            reference = None
        elif not isinstance(reference, str):
            raise MatrixError(f"{where}: reference must be a run name or false, got {reference!r}")
        runs.append(
            RunSpec(
                name=name,
                devices=devices,
                options=options,
                reference=None if name == settings.baseline or perturb else reference,
                judged=name != settings.baseline and reference is not None and not perturb,
                rerun_of=rerun_of,
                optional=bool(raw.get("optional", False)),
                timeout_s=_timeout(raw.get("timeout_s"), where),
                speed_reference=_name_or_none(raw, "speed_reference", where),
                hardware=_name_or_none(raw, "hardware", where),
                kind=kind,
                path=path,
                perturb=perturb,
                **extras,
            )
        )
    if settings.baseline not in names:
        raise MatrixError(
            f"{source}: baseline {settings.baseline!r} is not one of the runs {sorted(names)}"
        )
    for spec in runs:
        for key in ("reference", "speed_reference"):
            value = getattr(spec, key)
            if value is not None and value not in names:
                raise MatrixError(f"{source} run {spec.name!r}: {key} {value!r} is not a run")
    notes: list[str] = []
    if settings.align_vocab:
        trained = [r for r in runs if r.kind == "train"]
        aligned, notes = align_vocab_padding(trained) if trained else ([], [])
        by_name = {r.name: r for r in aligned}
        runs = [by_name.get(r.name, r) for r in runs]
    for spec in runs:
        if spec.kind == "train":
            _check_train_options(spec, f"{source} run {spec.name!r}")
    _check_script_checkpoints(runs, source)
    return Matrix(source=source, settings=settings, runs=tuple(runs), notes=tuple(notes))


def _script_value(args: tuple[str, ...], option: str) -> str | None:
    """The value a script's arguments give ``option`` (``--opt V`` or ``--opt=V``; the last one
    counts, as with argparse): None when absent, ``""`` when it ends the arguments valueless."""
    value = None
    for index, arg in enumerate(args):
        if arg == option:
            value = args[index + 1] if index + 1 < len(args) else ""
        elif arg.startswith(f"{option}="):
            value = arg.partition("=")[2]
    return value


def _script_folder(args: tuple[str, ...], option: str) -> str | None:
    """The folder a script's ``option`` (``--save``, ``--load``) names, absolute (the script
    runs in compare's working directory), or None."""
    value = _script_value(args, option)
    return os.path.abspath(value) if value else None


def _check_script_checkpoints(runs: list[RunSpec], source: str) -> None:
    """Script runs (a rerun takes its original's arguments) must not share a ``--save`` folder:
    a later run would resume from the earlier run's checkpoint instead of training, and write
    over it."""
    saves: dict[str, str] = {}
    for spec in runs:
        if spec.kind != "script":
            continue
        folder = _script_folder(spec.script_args, "--save")
        loads = _script_folder(spec.script_args, "--load")
        for used, why in ((folder, "saves to"), (loads, "loads from")):
            if used is not None and used in saves:
                raise MatrixError(
                    f"{source} run {spec.name!r} {why} {used}, where run {saves[used]!r} saves: "
                    "give each script run a --save folder of its own"
                )
        if folder is not None:
            saves[folder] = spec.name


def align_vocab_padding(runs: list[RunSpec]) -> tuple[list[RunSpec], list[str]]:
    """Give every run the same padded vocabulary (see the module docstring)."""
    multiples = [
        int(r.option("make-vocab-size-divisible-by", DEFAULT_DIVISIBLE_BY)) * r.tensor_parallel
        for r in runs
    ]
    common = math.lcm(*multiples)
    out, changed = [], {}
    for spec in runs:
        wanted = common // spec.tensor_parallel
        current = int(spec.option("make-vocab-size-divisible-by", DEFAULT_DIVISIBLE_BY))
        if wanted != current:
            spec = replace(spec, options={**spec.options, "make-vocab-size-divisible-by": wanted})
            changed.setdefault((current, wanted, spec.tensor_parallel), []).append(spec.name)
        out.append(spec)
    notes = [
        f"vocabulary padding aligned to a multiple of {common}: make-vocab-size-divisible-by "
        f"{current} -> {wanted} for the TP{tp} run(s) {', '.join(names)}"
        for (current, wanted, tp), names in changed.items()
    ]
    return out, notes


RUN_KEYS = frozenset(
    {
        "name",
        "device",
        "options",
        "reference",
        "rerun_of",
        "optional",
        "timeout_s",
        "speed_reference",
        "hardware",
        "import",
        "run",
        "script",
        "args",
        "nproc_per_node",
        "perturb",
    }
)
#: the train option each perturbation sets on the rerun (``threads`` changes its environment);
#: a script run's rerun takes the same number of ulps from its environment
#: (:func:`megatron_npu.compare.runner.perturbation_env`)
PERTURB_OPTIONS = {"init-ulp": ("init-ulp-nudge", 1), "init-ulp-down": ("init-ulp-nudge", -1)}


def _perturbed(
    original: RunSpec, perturb: Any, where: str, extras: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (train options, script fields) of a perturbed rerun of ``original``: a train run
    gets the option, a script run its arguments (the next ``--seed``) or, for the other
    perturbations, only another environment."""
    if perturb not in noise.PERTURBATIONS:
        raise MatrixError(
            f"{where}: perturb must be one of {list(noise.PERTURBATIONS)}, got {perturb!r}"
        )
    options = dict(original.options)
    if original.kind == "script":
        return options, {**extras, "script_args": _perturbed_script_args(original, perturb, where)}
    if perturb in PERTURB_OPTIONS:
        key, value = PERTURB_OPTIONS[perturb]
        options[key] = value
    elif perturb == noise.SCALE:
        from megatron_npu.training.arguments import DEFAULT_SEED

        options["seed"] = int(options.get("seed", DEFAULT_SEED)) + 1
    return options, extras


#: the script options whose checkpoint replaces the initial weights (Megatron-LM loads
#: ``--pretrained-checkpoint`` when ``--load`` holds none)
_LOADS = ("--load", "--pretrained-checkpoint")


def _perturbed_script_args(original: RunSpec, perturb: str, where: str) -> tuple[str, ...]:
    """A script run's arguments for a ``perturb`` rerun: the next ``--seed`` for ``seed`` (the
    last one given, the one argparse keeps; Megatron-LM's default when none is); unchanged
    otherwise, except that nudged initial weights cannot survive a loaded checkpoint."""
    from megatron_npu.training.arguments import DEFAULT_SEED

    args = list(original.script_args)
    loads = [o for o in _LOADS if _script_value(original.script_args, o) is not None]
    if perturb in PERTURB_OPTIONS and loads:
        raise MatrixError(
            f"{where}: perturb = {perturb!r} moves the initial weights, and the script's "
            f"{loads[0]} replaces them with a checkpoint's: drop it, or perturb by threads"
        )
    if perturb != noise.SCALE:
        return tuple(args)
    for index in reversed(range(len(args))):
        arg = args[index]
        if arg != "--seed" and not arg.startswith("--seed="):
            continue
        if arg == "--seed" and index + 1 == len(args):
            raise MatrixError(f"{where}: the script's --seed has no value")
        given = args[index + 1] if arg == "--seed" else arg.partition("=")[2]
        try:
            seed = int(given)
        except ValueError:
            raise MatrixError(f"{where}: the script's --seed {given!r} is not an integer") from None
        if arg == "--seed":
            return (*args[: index + 1], str(seed + 1), *args[index + 2 :])
        return (*args[:index], f"--seed={seed + 1}", *args[index + 1 :])
    return (*args, "--seed", str(DEFAULT_SEED + 1))


def _name_or_none(raw: dict, key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise MatrixError(f"{where}: {key} must be a non-empty string, got {value!r}")
    return value


def _source(raw: dict, base_dir: Path, where: str) -> tuple[str, str | None, dict[str, Any]]:
    """(kind, path, extra RunSpec fields) of a run: trained here, imported, or a script."""
    if "import" in raw and "script" in raw:
        raise MatrixError(f"{where}: a run is either import = ... or script = ..., not both")
    if "import" in raw:
        bad = sorted({"options", "rerun_of", "args", "nproc_per_node", "timeout_s"} & set(raw))
        if bad:
            raise MatrixError(f"{where}: an imported run takes no {bad}: it is not run here")
        path = _name_or_none(raw, "import", where)
        return "import", str(base_dir / path), {"import_run": _name_or_none(raw, "run", where)}
    if "run" in raw:
        raise MatrixError(
            f"{where}: run = ... names a run of an imported results.json; add import = ..."
        )
    if "script" in raw:
        if "rerun_of" in raw or "options" in raw:
            raise MatrixError(
                f"{where}: a script run takes its arguments in args = [...], not options/rerun_of"
            )
        path = _name_or_none(raw, "script", where)
        args = raw.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str | int | float) for a in args):
            raise MatrixError(f"{where}: args must be a list of strings, got {args!r}")
        nproc = raw.get("nproc_per_node", 1)
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise MatrixError(f"{where}: nproc_per_node must be a positive integer, got {nproc!r}")
        return (
            "script",
            str(base_dir / path),
            {
                "script_args": tuple(str(a) for a in args),
                "nproc_per_node": nproc,
            },
        )
    for key in ("args", "nproc_per_node"):
        if key in raw:
            raise MatrixError(f"{where}: {key} belongs to a script = ... run")
    return "train", None, {}


def _timeout(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise MatrixError(f"{where}: timeout_s must be a positive number of seconds, got {value!r}")
    return float(value)


def load(path: str | Path | None) -> Matrix:
    """Read a matrix file; ``None`` reads the shipped default matrix."""
    source = "default" if path is None else str(path)
    file = DEFAULT_MATRIX if path is None else Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"cannot read matrix {source}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{source}: not valid TOML: {exc}") from None
    return parse(data, source, file.resolve().parent)
