"""``megatron-npu locate``: the whole search (docs/locate.md).

1. **step** -- both runs train (or their ``compare`` curves are read) and
   :func:`~.curves.first_divergent_step` names the first step beyond the approximate rule's
   tolerance (``--step`` skips this);
2. **module** -- the reference replays up to that step, saves a checkpoint just before it (in its
   dump folder) and dumps the step; the candidate loads that checkpoint and dumps the same step
   (same weights, same batch); :func:`~.modules.compare_dumps` names the first module whose error
   its inputs do not explain;
3. **patch** -- :func:`~.culprit.search` replays the candidate's step with the patches that
   module reaches switched off, halving the set, until one patch (or a minimal set) is left whose
   removal brings the module back within tolerance;
4. ``<out>/locate.json`` (:class:`megatron_npu.formats.locate_result.LocateResult`) and the
   command that reproduces it.

With no divergent step (the curves agree) the first step is replayed and compared all the same:
the result then says that no module diverges.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import Any

from megatron_npu import console
from megatron_npu.formats.locate_dump import ModuleInfo
from megatron_npu.formats.locate_msprobe import LocateMsprobeResult
from megatron_npu.formats.locate_result import FILENAME, LocateResult
from megatron_npu.locate import (
    curves,
    dump,
    modules,
    msprobe_dumps,
    script_runs,
    worker,
)
from megatron_npu.locate.culprit import search

#: train options that locate sets itself (a compare run's command carries them), and the launch
#: option it reads as the side's world
_SET_BY_LOCATE = (
    "--metrics-out",
    "--progress",
    "--save",
    "--load",
    "--save-interval",
    "--no-save-optim",
    "--no-save-rng",
    "--nproc-per-node",
)


#: a culprit-search item that serves a torch_npu kernel natively (the rest are patch ids)
KERNEL_ITEM = "kernel:"


class LocateError(ValueError):
    """Bad input to ``megatron-npu locate`` (reported as one line, exit status 2)."""


@dataclass
class RunSide:
    """One of the two runs: ``megatron-npu train`` options (``argv``, ``--device`` included,
    without ``--nproc-per-node`` and the options locate sets), or with ``script`` a user's
    Megatron-LM script, ``argv`` then being the script's own arguments."""

    label: str
    argv: list[str]
    world: int = 1
    plant: str | None = None  # testing aid: a parity mutation planted in this run
    disable: list[str] = field(default_factory=list)
    script: str | None = None
    device: str = "auto"
    train_iters: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {
            "label": self.label,
            "device": self.device,
            "argv": self.argv,
            "world": self.world,
            "disable": self.disable,
        }
        if self.script:
            out["script"] = self.script
        if self.plant:
            out["plant"] = self.plant
        return out


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in a Megatron-LM script's or a launcher's command line (train's
    own options are read by train's parser, :func:`train_side`)."""
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.partition("=")[2]
    return None


def train_side(label: str, argv: list[str], plant: str | None = None) -> RunSide:
    """A side that trains with ``megatron-npu train``: its options parsed and checked by train's
    own parser (a bad option is named before any replay starts); the options locate sets itself
    left out of what the replays carry."""
    from megatron_npu.training import arguments
    from megatron_npu.training.options import TrainOptions

    try:
        options = TrainOptions.parse(argv)
    except arguments.ArgumentError as exc:
        raise LocateError(f"--{label} options: {exc}") from None
    return RunSide(
        label,
        options.argv(without=_SET_BY_LOCATE),
        options.world_size,
        plant,
        list(options.disabled),
        device=options.args.device or "auto",
        train_iters=options.args.train_iters,
    )


def side_from_options(label: str, options: str, common: str, plant: str | None) -> RunSide:
    side = train_side(label, shlex.split(common) + shlex.split(options), plant)
    if side.device == "auto":
        raise LocateError(f"--{label} options must name --device")
    return side


def script_side(label: str, options: str, common: str, script: str) -> RunSide:
    """A side of ``--script``: ``--device D`` (and ``--nproc-per-node N``) from its options, the
    rest the script's own arguments."""
    if not Path(script).is_file():
        raise LocateError(f"--script: no script {script!r}")
    try:
        argv, device, world, disable = script_runs.split_options(
            shlex.split(common) + shlex.split(options)
        )
    except ValueError as exc:
        raise LocateError(f"--{label}: {exc}") from None
    if device is None:
        raise LocateError(f"--{label} options must name --device")
    return RunSide(
        label,
        argv,
        world,
        None,
        disable,
        str(Path(script).resolve()),
        device,
        _iterations(argv),
    )


def _iterations(script_args: list[str]) -> int | None:
    value = _option(script_args, "--train-iters")
    return int(value) if value and value.isdigit() else None


def _script_side_from_command(name: str, command: list[str], metrics: Path) -> RunSide:
    """A compare script run (``torchrun ... -m megatron_npu.run_script SCRIPT ARGS``): its
    device is the one its metrics name."""
    at = command.index("megatron_npu.run_script")
    launcher, script, script_args = command[:at], command[at + 1], command[at + 2 :]
    world = int(_option(launcher, "--nproc-per-node") or 1)
    from megatron_npu.formats import FormatError
    from megatron_npu.formats.metrics import MetricsFile

    try:
        device = MetricsFile.read(metrics).config.device
    except FormatError as exc:
        raise LocateError(f"compare run {name!r}: {exc}") from None
    argv, _, _, disable = script_runs.split_options(script_args)
    return RunSide(name, argv, world, None, disable, script, device or "auto", _iterations(argv))


def side_from_compare(out_dir: Path, name: str) -> tuple[RunSide, Path]:
    """A compare run's options (from its ``run.json`` command: a train or a script run) and its
    metrics file."""
    from megatron_npu.formats import FormatError
    from megatron_npu.formats.run_record import RunRecord

    run_dir = out_dir / "runs" / name
    metrics = run_dir / "metrics.json"
    if not (run_dir / "run.json").is_file() or not metrics.is_file():
        raise LocateError(f"{out_dir}: no finished compare run named {name!r} ({run_dir})")
    try:
        record = RunRecord.read(run_dir / "run.json")
    except FormatError as exc:
        raise LocateError(str(exc)) from None
    command = list(record.command or [])
    if command[:1] == ["env"]:
        changed = " ".join(takewhile(lambda a: "=" in a, command[1:]))
        raise LocateError(
            f"compare run {name!r} ran with {changed} (a perturbed rerun): locate replays both "
            "runs under one environment; name the run it reruns"
        )
    if "megatron_npu.run_script" in command:
        return _script_side_from_command(name, command, metrics), metrics
    if "train" not in command:
        raise LocateError(
            f"{run_dir / 'run.json'}: its command is neither a train nor a script run"
        )
    return train_side(name, command[command.index("train") + 1 :]), metrics


class Locator:
    def __init__(
        self,
        reference: RunSide,
        candidate: RunSide,
        out: Path,
        *,
        limit: int,
        rule_base: float | None,
        gain: float,
        growth: float,
        timeout_s: float,
        max_trials: int = 16,
    ) -> None:
        if reference.world != candidate.world:
            raise LocateError(
                f"the runs have different worlds ({reference.world} vs {candidate.world} ranks): "
                "locate replays both in the same layout"
            )
        self.reference, self.candidate, self.out = reference, candidate, out
        self.limit, self.rule_base, self.gain, self.growth = limit, rule_base, gain, growth
        self.timeout_s = timeout_s
        self.max_trials = max_trials
        self.timing: dict[str, float] = {}
        self._trials = 0
        # every replay runs under the environment locate started with: a library that sets a
        # variable in this process on the way (torch's compiler writes its cache folder's) must
        # not make one replay's conditions differ from another's, nor restart the warm ranks'
        # fork server
        self.environment = worker.replay_environment()

    def _run(self, side: RunSide, spec: dict[str, Any], log: str, disable: list[str] = ()) -> None:
        """One run of ``side``; ``disable`` holds the trial's items: patch ids to switch off and
        ``kernel:NAME`` items, kernels to serve natively with their patches installed."""
        patches = [d for d in disable if not d.startswith(KERNEL_ITEM)]
        kernels = sorted(d.removeprefix(KERNEL_ITEM) for d in disable if d.startswith(KERNEL_ITEM))
        spec = {
            "argv": side.argv,
            "plant": side.plant,
            "native_kernels": kernels,
            "disable": sorted(set(side.disable) | set(patches)),
            **spec,
        }
        log_path = self.out / "logs" / f"{log}.log"
        if side.script:
            spec.update(script=side.script, script_args=side.argv, device=side.device)
            script_runs.run(spec, side.world, self.timeout_s, log_path, env=self.environment)
        else:
            worker.run(spec, side.world, self.timeout_s, log_path, env=self.environment)

    def curves(self, ref_metrics: Path | None, cand_metrics: Path | None) -> curves.StepFinding:
        start = time.perf_counter()
        paths, jobs = {}, []
        for side, given in ((self.reference, ref_metrics), (self.candidate, cand_metrics)):
            if given is None:
                given = self.out / "curves" / f"{side.label}.json"
                given.parent.mkdir(parents=True, exist_ok=True)
                iters = side.train_iters
                console.say(f" locate: training {side.label} ({side.device}) for {iters} steps")
                name = "reference" if side is self.reference else "candidate"
                # step 1 is dumped on the way: a bug in the first step needs no replay
                spec = {
                    "stop": int(iters) if iters else None,
                    "curve": str(given),
                    "hook_step": 1,
                    "limit": self.limit,
                    "dump": str(self.out / "dumps" / name),
                }
                jobs.append((side, spec, f"curve-{side.label}"))
            paths[side.label] = given
        with ThreadPoolExecutor(max_workers=2) as pool:  # the two runs side by side
            for future in [pool.submit(self._run, *job) for job in jobs]:
                future.result()
        ref = curves.read_record(paths[self.reference.label])
        cand = curves.read_record(paths[self.candidate.label])
        resolution = {
            q: max(ref.resolution.get(q, 0.0), cand.resolution.get(q, 0.0))
            for q in ("loss", "grad_norm")
        }
        finding = curves.first_divergent_step(ref.curve, cand.curve, resolution=resolution)
        self.timing["curves_s"] = round(time.perf_counter() - start, 2)
        return finding

    def dump_reference(self, step: int) -> Path:
        start = time.perf_counter()
        folder = self.out / "dumps" / "reference"
        shutil.rmtree(folder, ignore_errors=True)
        spec = {
            "stop": step,
            "hook_step": step,
            "dump": str(folder),
            "limit": self.limit,
            "save_before": str(folder / "checkpoint") if step > 1 else None,
        }
        console.say(f" locate: replaying step {step} of {self.reference.label} with hooks")
        self._run(self.reference, spec, "dump-reference")
        self.timing["dump_reference_s"] = round(time.perf_counter() - start, 2)
        return folder

    def dump_candidate(
        self, step: int, reference_dump: Path, name: str, disable: list[str] = ()
    ) -> Path:
        folder = self.out / "dumps" / name
        shutil.rmtree(folder, ignore_errors=True)
        checkpoint = reference_dump / "checkpoint"
        spec = {
            "stop": step,
            "hook_step": step,
            "dump": str(folder),
            "limit": self.limit,
            "load": str(checkpoint) if step > 1 else None,
            "trial": bool(disable),
        }
        if step > 1 and not checkpoint.is_dir():
            raise LocateError(f"{reference_dump}: no checkpoint/ to replay step {step} from")
        self._run(self.candidate, spec, f"dump-{name}", disable)
        return folder

    def rule(self, reference_dump: Path) -> modules.Rule:
        base = modules.rule_for(dump.read_meta(reference_dump).dtype)
        dtype = None
        try:
            dtype = dump.read_meta(self.out / "dumps" / "candidate").dtype
        except dump.DumpError:
            pass
        rule = modules.rule_for(dtype or "float32", self.rule_base)
        if self.rule_base is None:  # the looser of the two dtypes' bases
            rule = modules.Rule(max(rule.base, base.base))
        return modules.Rule(rule.base, self.growth, self.gain)

    def culprit(
        self, step: int, reference_dump: Path, candidate_dump: Path, comparison: modules.Comparison
    ):
        row, phase = comparison.first
        table = dump.read_rank(candidate_dump, row.rank)[0].modules
        all_reached = sorted({p for info in table.values() for p in info.patches.total})
        applied = sorted(dump.read_meta(candidate_dump).applied)
        common = _ubiquitous(table)
        if phase == "update":  # the optimizer step changed the parameters
            optimizer = table.get(dump.OPTIMIZER)
            own = optimizer.patches.own if optimizer else []
            sets = [own, all_reached, applied]
        else:
            own, total = row.patches.own, row.patches.total
            sets = [own, total, all_reached, applied]
        # each set first as its patches that change numerics (those with a parity case), then
        # without the patches nearly every module reaches (device plumbing), then whole:
        # cheaper to search, and switching plumbing off rarely runs at all
        numeric = _numeric_patches()
        sets = [
            s
            for full in sets
            for s in (
                [p for p in full if p in numeric and p not in common],
                [p for p in full if p not in common],
                full,
            )
        ]
        # on a device with torch_npu kernels, first the kernels the module's patches call,
        # served natively with the patches installed: the narrowest trial, and one that runs
        # where switching the whole patch off leaves Megatron code the configuration cannot run
        kernels = _declared_kernels()
        if dump.read_meta(candidate_dump).npu_kernels:
            near = [own] if phase == "update" else [own, row.patches.total]
            sets = [
                sorted({KERNEL_ITEM + k for p in full for k in kernels.get(p, ())}) for full in near
            ] + sets
        start = time.perf_counter()

        def replay(disabled: list[str]) -> tuple[bool | None, str]:
            self._trials += 1
            name = f"trial-{self._trials}"
            console.say(
                f" locate: trial {self._trials}: {row.module} with {_trial_words(disabled)}"
            )
            try:
                folder = self.dump_candidate(step, reference_dump, name, disabled)
                trial = modules.compare_dumps(reference_dump, folder, comparison.rule, {row.module})
            except (worker.WorkerError, dump.DumpError) as exc:
                return None, str(exc).splitlines()[0]
            same = [r for r in trial.rows if r.rank == row.rank and phase in r.phases]
            if not same:
                return None, f"{row.module} not recorded in the trial"
            err = same[0].phases[phase]
            return not err.diverges, f"{phase} error {err.output:.3g} (input {err.input:.3g})"

        found = search(sets, replay, self.max_trials)
        if any(c.startswith(KERNEL_ITEM) for c in found.culprits):
            # a kernel served natively fixed it: the culprit is the patch that calls it here
            found.kernels = [c.removeprefix(KERNEL_ITEM) for c in found.culprits]
            calling = [
                sorted(p for p in reached if set(kernels.get(p, ())) & set(found.kernels))
                for reached in (own, row.patches.total, all_reached)
            ]
            found.culprits = next((c for c in calling if c), [])
        self.timing["culprit_s"] = round(time.perf_counter() - start, 2)
        return found


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value if value is not None else "-")


def _trial_words(items: list[str]) -> str:
    """What a trial changes, in words: patches off, kernels served natively."""
    patches = [i for i in items if not i.startswith(KERNEL_ITEM)]
    kernels = [i.removeprefix(KERNEL_ITEM) for i in items if i.startswith(KERNEL_ITEM)]
    words = [f"{', '.join(patches)} off"] if patches else []
    words += [f"kernel {', '.join(kernels)} served natively"] if kernels else []
    return "; ".join(words)


def _declared_kernels() -> dict[str, tuple[str, ...]]:
    """Each patch's declared torch_npu kernels (the registry's ``npu_kernels``)."""
    from megatron_npu.registry import all_patches

    return {p.id: p.npu_kernels for p in all_patches() if p.npu_kernels}


def _numeric_patches() -> set[str]:
    """Patches with a parity case: those that compute something (not device plumbing)."""
    from megatron_npu.registry import all_patches

    return {p.id for p in all_patches() if p.parity is not None}


def _ubiquitous(table: dict[str, ModuleInfo]) -> set[str]:
    """Patches in the own set of more than half of the modules that reach any patch."""
    owns = [set(info.patches.own) for info in table.values()]
    owns = [o for o in owns if o]
    counts: dict[str, int] = {}
    for own in owns:
        for pid in own:
            counts[pid] = counts.get(pid, 0) + 1
    return {pid for pid, n in counts.items() if n > len(owns) / 2}


def _clear_dumps(out: Path, keep: str | None) -> None:
    """A rerun into the same folder never reads the last run's dumps (the code may have
    changed since); a reference dump given with --reference-dump is kept."""
    folder = out / "dumps"
    if not folder.is_dir():
        return
    kept = Path(keep).resolve() if keep else None
    for item in folder.iterdir():
        if kept is not None and (kept == item.resolve() or item.resolve() in kept.parents):
            continue
        shutil.rmtree(item, ignore_errors=True)


def _has_dump(folder: Path, step: int) -> bool:
    try:
        return dump.read_meta(folder).step == step
    except dump.DumpError:
        return False


def reproduce_command(args: argparse.Namespace, step: int | None) -> str:
    parts = ["megatron-npu", "locate"]
    if args.compare_dir:
        parts += ["--compare-dir", str(args.compare_dir), "--pair", *args.pair]
    else:
        if args.script:
            parts += ["--script", str(args.script)]
        parts += ["--reference", args.reference, "--candidate", args.candidate]
        if args.common:
            parts += ["--common", args.common]
        if args.reference_curve:
            parts += [
                "--reference-curve",
                str(args.reference_curve),
                "--candidate-curve",
                str(args.candidate_curve),
            ]
    if step is not None:
        parts += ["--step", str(step)]
    if args.plant_candidate:
        parts += ["--plant-candidate", args.plant_candidate]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def locate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the search for parsed ``args``; write and return the locate.json content."""
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ref_metrics = cand_metrics = None
    if args.compare_dir:
        reference, ref_metrics = side_from_compare(Path(args.compare_dir), args.pair[0])
        candidate, cand_metrics = side_from_compare(Path(args.compare_dir), args.pair[1])
    else:
        if not (args.reference and args.candidate):
            raise LocateError("give --reference and --candidate options, or --compare-dir --pair")
        if args.script:
            if args.plant_candidate:
                raise LocateError(
                    "--plant-candidate plants in megatron-npu train runs, not in a script"
                )
            reference = script_side("reference", args.reference, args.common or "", args.script)
            candidate = script_side("candidate", args.candidate, args.common or "", args.script)
        else:
            reference = side_from_options("reference", args.reference, args.common or "", None)
            candidate = side_from_options(
                "candidate", args.candidate, args.common or "", args.plant_candidate
            )
    if args.reference_curve or args.candidate_curve:
        if args.compare_dir:
            raise LocateError("--reference-curve/--candidate-curve are for --reference/--candidate")
        if not (args.reference_curve and args.candidate_curve):
            raise LocateError("give both --reference-curve and --candidate-curve")
        ref_metrics, cand_metrics = Path(args.reference_curve), Path(args.candidate_curve)
    _clear_dumps(out, args.reference_dump)
    loc = Locator(
        reference,
        candidate,
        out,
        limit=args.limit,
        rule_base=args.base_tolerance,
        gain=args.gain,
        growth=args.depth_growth,
        timeout_s=args.timeout,
        max_trials=args.max_trials,
    )
    if args.step is not None:
        finding = curves.StepFinding(args.step, None, None, None, {"status": "not-run"})
    else:
        finding = loc.curves(ref_metrics, cand_metrics)
    step = finding.step if finding.step is not None else 1
    console.say(
        f" locate: first divergent step: {finding.step} ({finding.quantity or 'curves agree'})"
    )
    if args.reference_dump:
        ref_dump = Path(args.reference_dump)
        meta = dump.read_meta(ref_dump)
        if meta.step != step:
            raise LocateError(f"{ref_dump} holds step {meta.step}, not step {step}")
    elif _has_dump(out / "dumps" / "reference", step):
        ref_dump = out / "dumps" / "reference"  # made by the curve run
    else:
        ref_dump = loc.dump_reference(step)
    cand_dump = None
    if not args.dump_only:
        start = time.perf_counter()
        if _has_dump(out / "dumps" / "candidate", step):
            cand_dump = out / "dumps" / "candidate"
        else:
            console.say(f" locate: replaying step {step} of {candidate.label} with hooks")
            cand_dump = loc.dump_candidate(step, ref_dump, "candidate")
        loc.timing["dump_candidate_s"] = round(time.perf_counter() - start, 2)
    data: dict[str, Any] = {
        "reference": reference.as_dict(),
        "candidate": candidate.as_dict(),
        "step": finding.as_dict(),
        "replayed_step": step,
        "dumps": {"reference": str(ref_dump), "candidate": str(cand_dump) if cand_dump else None},
        "modules": [],
        "divergent": None,
        "culprit": None,
    }
    if cand_dump is not None:
        start = time.perf_counter()
        comparison = modules.compare_dumps(ref_dump, cand_dump, loc.rule(ref_dump))
        loc.timing["compare_s"] = round(time.perf_counter() - start, 2)
        data["rule"] = comparison.rule.as_dict()
        data["modules"] = [r.as_dict() for r in comparison.rows]
        data["divergent"] = comparison.first_dict()
        bound = comparison.gradient_bound()
        data["gradient_bound"] = bound
        worst = bound["worst"] or {}
        console.say(
            f" locate: TTrace's gradient bound: {len(bound['exceeding'])} of "
            f"{bound['parameters']} gradients beyond it (worst {worst.get('parameter', '-')}: "
            f"{_short(worst.get('error'))} against {_short(worst.get('bound'))})"
        )
        if comparison.first is not None:
            row, phase = comparison.first
            console.say(f" locate: first divergent module: {row.name} ({row.kind}, {phase})")
            measured = comparison.first_msprobe
            if measured:
                console.say(msprobe_line(measured, f"its worst tensor ({measured['data_name']})"))
            if not args.no_culprit:
                found = loc.culprit(step, ref_dump, cand_dump, comparison)
                data["culprit"] = found.as_dict()
                named = (
                    ", ".join(found.culprits)
                    + (f" (its kernel {', '.join(found.kernels)})" if found.kernels else "")
                    if found.culprits
                    else (
                        f"not found (suspects: {', '.join(found.suspects)})"
                        if found.suspects
                        else "not found"
                    )
                )
                console.say(f" locate: culprit: {named}")
        else:
            console.say(" locate: no divergent module")
    loc.timing["total_s"] = round(time.perf_counter() - started, 2)
    data["timing"] = loc.timing
    data["reproduce"] = reproduce_command(args, finding.step)
    path = LocateResult.of(data).write(out / FILENAME)
    console.say(f" locate: {path} ({loc.timing['total_s']:.0f} s)")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("the two runs")
    g.add_argument(
        "--reference",
        help="train options of the reference run (one quoted string, "
        "--device included; with --script: --device D [--nproc-per-node N] and the "
        "script's own arguments)",
    )
    g.add_argument("--candidate", help="options of the candidate run (as --reference)")
    g.add_argument("--common", help="options both runs share")
    g.add_argument(
        "--script",
        metavar="PATH",
        help="both runs are this Megatron-LM script (e.g. pretrain_gpt.py) through the adaptor; "
        "replays use its own --save/--load/--exit-interval",
    )
    g.add_argument(
        "--reference-curve",
        metavar="PATH",
        help="the reference run's per-step record, already made: a Megatron-LM log, its "
        "TensorBoard folder or a megatron-npu metrics.json (the step is read from it instead "
        "of training the run)",
    )
    g.add_argument(
        "--candidate-curve",
        metavar="PATH",
        help="the candidate run's record (as --reference-curve)",
    )
    g.add_argument("--compare-dir", help="a compare output folder: take the runs from it")
    g.add_argument(
        "--pair",
        nargs=2,
        metavar=("REFERENCE", "CANDIDATE"),
        help="with --compare-dir: the two run names (e.g. the failing pair)",
    )
    g.add_argument(
        "--msprobe",
        nargs=2,
        metavar=("REF", "CAND"),
        help="two msprobe dumps made anywhere (a dump folder, a step<N> or rank<R> folder, or a "
        "dump.json; levels L0, L1 and mix, tensor or statistics): name the first module or API "
        "whose error its inputs do not explain (writes locate-msprobe.json)",
    )
    g.add_argument("--plant-candidate", help=argparse.SUPPRESS)  # testing aid: a parity mutation
    s = parser.add_argument_group("search")
    s.add_argument("--step", type=int, default=None, help="replay this step (skip the curves)")
    s.add_argument(
        "--limit",
        type=int,
        default=dump.DEFAULT_LIMIT,
        help="elements kept per tensor (larger ones: statistics and a sample)",
    )
    s.add_argument(
        "--base-tolerance",
        type=float,
        default=None,
        help="module rel-L2 tolerance at depth 0 (default by dtype)",
    )
    s.add_argument(
        "--gain",
        type=float,
        default=modules.GAIN,
        help="how much a module may amplify its inputs' error",
    )
    s.add_argument("--depth-growth", type=float, default=modules.DEPTH_GROWTH)
    s.add_argument("--no-culprit", action="store_true", help="stop after naming the module")
    s.add_argument(
        "--max-trials", type=int, default=16, help="most replays the culprit search may run"
    )
    s.add_argument(
        "--dump-only",
        action="store_true",
        help="only dump the reference's step (take the folder to another machine)",
    )
    s.add_argument("--reference-dump", help="a reference dump made elsewhere (--dump-only)")
    s.add_argument("--timeout", type=float, default=900.0, help="seconds per worker run")
    parser.add_argument("--out", required=True, help="output folder (locate.json, dumps, logs)")


def msprobe_line(metrics: dict[str, Any], what: str) -> str:
    """msprobe compare's metrics of the named row, beside locate's verdict."""
    verdict = "pass" if metrics["passes_msprobe_thresholds"] else "fail"
    cosine = "n/a" if metrics["cosine"] is None else f"{metrics['cosine']:.6f}"
    return (
        f" locate: msprobe's own metrics for {what}: cosine {cosine}, max abs error "
        f"{metrics['max_abs_error']:.3g}, max rel error {metrics['max_rel_error']:.3g} "
        f"(cosine > {modules.MSPROBE_COSINE} and max abs error < {modules.MSPROBE_MAX_ABS}: "
        f"{verdict})"
    )


def locate_msprobe(args: argparse.Namespace) -> LocateMsprobeResult:
    """``--msprobe REF CAND``: compare two msprobe dumps row by row with the input-explained
    rule (:mod:`.msprobe_dumps`); write and return ``locate-msprobe.json``."""
    ref_path, cand_path = args.msprobe
    reference, candidate = msprobe_dumps.read_dump(ref_path), msprobe_dumps.read_dump(cand_path)
    rule = None
    if args.base_tolerance is not None:
        rule = modules.Rule(args.base_tolerance, args.depth_growth, args.gain)
    found = msprobe_dumps.compare(reference, candidate, rule)
    data = LocateMsprobeResult.parse(
        {
            "format": msprobe_dumps.RESULT_FORMAT,
            "schema_version": 1,
            "reference": str(ref_path),
            "candidate": str(cand_path),
            **found,
        }
    )
    path = data.write(Path(args.out) / msprobe_dumps.RESULT_FILE)
    row = data.divergent
    console.say(
        f" locate: msprobe {data.task} dumps, levels {', '.join(data.levels)}, "
        f"{len(data.rows)} rows compared over {', '.join(data.ranks)}"
    )
    if row is None:
        console.say(" locate: no row diverges beyond what its inputs explain")
    else:
        console.say(
            f" locate: first divergent row: {row.name} ({row.rank}): error "
            f"{row.output:.3g} from inputs off by {row.input:.3g} (tolerance "
            f"{row.tolerance:.3g})"
        )
        if row.module != row.name:
            console.say(f" locate: inside {row.module}")
        if row.msprobe_metrics:
            console.say(msprobe_line(row.msprobe_metrics.model_dump(), "it"))
        reached = row.patches or row.module_patches or []
        console.say(
            " locate: adaptor patches it reaches (suspects; a dump cannot switch them off, run "
            f"locate on the runs to decide): {', '.join(reached) or 'none'}"
        )
    if data.statement:
        console.say(f" locate: {data.statement}")
    console.say(f" locate: {path}")
    return data


def main(args: argparse.Namespace) -> int:
    try:
        if args.msprobe:
            locate_msprobe(args)
            return 0
        if args.compare_dir and not args.pair:
            raise LocateError("--compare-dir needs --pair REFERENCE CANDIDATE")
        if args.limit < 1:
            raise LocateError("--limit must be positive")
        locate(args)
    except (
        LocateError,
        curves.CurveError,
        dump.DumpError,
        worker.WorkerError,
        msprobe_dumps.MsprobeDumpError,
    ) as exc:
        console.error(f"megatron-npu locate: {exc}")
        return 2
    return 0
