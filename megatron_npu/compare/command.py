"""``megatron-npu compare [MATRIX.toml] [--out DIR]``: run a matrix, judge it, write Table 2.

Runs execute one after another (train's progress lines are shown), each cached by config hash
(:mod:`.runner`); a failed run is reported and the rest go on. Then, per candidate, the rules of
:mod:`.rules` give one verdict each against its reference (fingerprint first; then
``deterministic`` for a rerun, ``layout`` for an fp32 run on the same device whose options differ
only in layout options, ``approximate`` otherwise) and ``performance`` against its speed reference,
like for like only; a slowdown between two local runs stands only when re-timing both back to back
shows it again (:func:`confirm_slowdown`). Imported runs (:mod:`.imports`) and script runs
(:func:`.runner.execute_script`) take part like trained ones.
Outputs: ``<out>/results.json``, ``<out>/table2.md``, ``<out>/runs/<name>/metrics.json``, and the
report of the reports package (``<out>/report.html``) when that package is importable.

Exit status: 0 when every run finished and no verdict failed or was refused (performance
included: it only times like-for-like pairs, see :func:`.rules.speed_mismatch`); 1 otherwise; 2
for a matrix that cannot be used.
"""

from __future__ import annotations

import importlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from megatron_npu.compare import datasheet, imports, noise, rules, runner, table2
from megatron_npu.compare import fingerprint as fp
from megatron_npu.compare import results as results_mod
from megatron_npu.compare.matrix import LAYOUT_OPTIONS, Matrix, RunSpec
from megatron_npu.devices import facts as device_facts
from megatron_npu.training.peak import plausible

DEFAULT_OUT = "compare-out"


@dataclass
class RunResult:
    spec: RunSpec
    device: str | None
    outcome: runner.Outcome | None
    metrics: dict[str, Any] | None = None
    lambada: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    provenance: dict[str, Any] | None = None  # where an imported run came from

    @property
    def ok(self) -> bool:
        return (
            self.outcome is not None
            and self.outcome.status in ("ok", "cached", "imported")
            and self.metrics is not None
        )

    @property
    def emulated(self) -> bool:
        if device_facts.emulated(self.device):
            return True
        if self.metrics is not None:
            return bool(self.metrics["config"].get("device_emulated"))
        return False

    @property
    def arguments(self) -> dict[str, Any]:
        return self.metrics["config"].get("arguments", {}) if self.metrics else {}

    def curve(self) -> rules.Curve:
        steps = self.metrics["steps"] if self.metrics else []
        return rules.Curve(
            iterations=[s["step"] for s in steps],
            losses=[None if s.get("skipped") else s.get("lm_loss") for s in steps],
            grad_norms=[s.get("grad_norm") for s in steps],
            step_times=[s["step_time_s"] for s in steps],
        )

    def fingerprint(self) -> dict[str, Any]:
        return fp.fingerprint(self.metrics["config"]) if self.metrics else {}

    def speed_setup(self) -> rules.SpeedSetup:
        args = self.arguments
        config = (self.metrics or {}).get("config", {})
        return rules.SpeedSetup(
            device=self.device,
            emulated=self.emulated,
            precision=_precision(args),
            layout=table2.layout_of(
                {**args, "data_parallel_size": config.get("data_parallel_size")},
                config.get("world_size"),
            ),
            shape={k: args.get(k) for k in SHAPE_ARGUMENTS},
            hardware=self.spec.hardware,
        )


#: The arguments that set a step's amount of work (with the model shape the fingerprint checks).
SHAPE_ARGUMENTS = ("seq_length", "micro_batch_size", "global_batch_size")


def _precision(options: dict[str, Any]) -> str:
    return "bf16" if options.get("bf16") else "fp16" if options.get("fp16") else "fp32"


def speed_reference(cand: RunResult, results: dict[str, RunResult], baseline: str) -> str:
    """The run ``cand`` is timed against: the matrix's ``speed_reference``, else its accuracy
    reference, else the baseline."""
    return cand.spec.speed_reference or cand.spec.reference or baseline


def accuracy_rule(cand: RunResult, ref: RunResult) -> str:
    """Which rule judges ``cand`` against ``ref`` (see the module docstring)."""
    if cand.spec.rerun_of == ref.spec.name:
        return "deterministic"
    keys = set(cand.spec.options) | set(ref.spec.options)
    differing = {k for k in keys if cand.spec.options.get(k) != ref.spec.options.get(k)}
    same_model_path = cand.device == ref.device
    fp32 = _precision(cand.spec.options) == _precision(ref.spec.options) == "fp32"
    # Megatron-LM's initial weights depend on the layout: only runs that both draw the
    # layout-independent ones are one model computed two ways
    same_weights = all(r.spec.options.get("layout-independent-init") for r in (cand, ref))
    if same_model_path and fp32 and same_weights and differing and differing <= LAYOUT_OPTIONS:
        return "layout"
    return "approximate"


def _mib(nbytes: int | None) -> float | None:
    return nbytes / 2**20 if nbytes is not None else None


def peak_memory(result: RunResult) -> rules.PeakMemory | None:
    """The run's peak memory and what measured it (its metrics say; older ones by device)."""
    summary = (result.metrics or {}).get("summary", {})
    memory = summary.get("peak_memory_bytes")
    # a metrics file that does not say what its peak measured (``peak_memory_measure``, written
    # since the host allocator peak) measured what its device measures
    device = device_facts.known(result.device)
    measure = summary.get("peak_memory_measure") or (device.memory_measure if device else None)
    if memory is None or measure is None:
        return None
    return rules.PeakMemory(int(memory), measure)


def perf_record(result: RunResult, warmup: int) -> dict[str, Any] | None:
    if not result.metrics:
        return None
    curve = result.curve()
    summary = result.metrics.get("summary", {})
    if summary.get("peak_memory_profiled_step") is not None:
        warmup = max(warmup, 1)  # the first step ran under the memory profiler: never timed
    stats = rules.step_time_stats(curve.step_times, warmup)
    args = result.arguments
    tokens = (args.get("global_batch_size") or 0) * (args.get("seq_length") or 0)
    flops = summary.get("model_flops_per_step")
    peak = summary.get("peak") or {}
    raw_mfu = mfu_ci95 = None
    if stats and flops and peak.get("tflops"):
        peak_flops = peak["tflops"] * 1e12 * summary.get("peak_devices", 1)
        raw_mfu = flops / stats.median / peak_flops
        # the s/step interval's ends, turned around: a slower step is a lower MFU
        mfu_ci95 = [flops / stats.ci95[1] / peak_flops, flops / stats.ci95[0] / peak_flops]
    mfu = plausible(raw_mfu) if rules.mfu_shown(result.emulated) else None
    peak_mem = peak_memory(result)
    measure = peak_mem.measure if peak_mem else None
    memory_mib = peak_mem.nbytes / 2**20 if peak_mem else None
    return {
        "median_s_per_step": stats.median if stats else None,
        "ci95_s_per_step": list(stats.ci95) if stats else None,
        "tokens_per_s": tokens / stats.median if stats and stats.median else None,
        "model_flops_per_step": flops,
        "mfu": mfu,
        "ci95_mfu": mfu_ci95 if mfu is not None else None,
        "peak_tflops": peak.get("tflops"),
        "peak_source": peak.get("source"),
        "peak_understated": rules.mfu_shown(result.emulated)
        and raw_mfu is not None
        and mfu is None,
        "mfu_note": None if rules.mfu_shown(result.emulated) else rules.EMULATED_SPEED,
        "peak_allocated_mib": memory_mib if measure == "allocator" else None,
        "peak_rss_mib": memory_mib if measure == "rss" else _mib(summary.get("peak_rss_bytes")),
        "speed_comparable": not result.emulated,
    }


def speed_verdict(cand: RunResult, other: RunResult, matrix: Matrix) -> rules.Verdict:
    """The performance verdict of ``cand`` timed against ``other`` (like for like only)."""
    s = matrix.settings
    sessions = [r.outcome.session if r.outcome else None for r in (cand, other)]
    local = cand.spec.kind != "import" and other.spec.kind != "import"
    mismatch = (
        "not timed in the same compare invocation (one of them was reused from an earlier one, "
        "under another machine load): run both again (a fresh --out) to time them"
        if local
        and (None in sessions or sessions[0] != sessions[1])
        and not cand.emulated
        and not other.emulated
        else None
    )
    models = fp.differences(other.fingerprint(), cand.fingerprint(), s.vary)
    if models and not mismatch:  # two different models are never timed against each other
        fields = ", ".join(f"{f} ({a!r} vs {b!r})" for f, a, b in models)
        mismatch = f"not like for like: another model than {other.spec.name} ({fields})"
    mismatch = mismatch or rules.speed_mismatch(
        cand.speed_setup(),
        other.speed_setup(),
        same_configuration=cand.spec.kind == other.spec.kind == "train"
        and cand.spec.options == other.spec.options,
        explicit=cand.spec.speed_reference == other.spec.name,
    )
    return rules.performance(
        cand.spec.name,
        other.spec.name,
        rules.step_time_stats(other.curve().step_times, s.warmup_steps),
        rules.step_time_stats(cand.curve().step_times, s.warmup_steps),
        mismatch=mismatch,
        threshold=s.perf_threshold,
        base_memory=peak_memory(other),
        cand_memory=peak_memory(cand),
        memory_threshold=s.memory_threshold,
    )


def noise_verdict(
    cand: RunResult, ref: RunResult, results: dict[str, RunResult], matrix: Matrix
) -> rules.Verdict | None:
    """``cand`` against the rounding band of ``ref``'s perturbed reruns (:mod:`.noise`), when
    the matrix has any."""
    perturbed = [r for r in results.values() if r.spec.rerun_of == ref.spec.name and r.spec.perturb]
    if not perturbed:
        return None
    rounding = {
        r.spec.name: r.curve() for r in perturbed if r.spec.perturb in noise.ROUNDING and r.ok
    }
    scale = next((r.curve() for r in perturbed if r.spec.perturb == noise.SCALE and r.ok), None)
    s = matrix.settings
    return noise.noise(
        cand.spec.name,
        ref.spec.name,
        ref.curve(),
        rounding,
        cand.curve(),
        factor=s.noise_factor,
        floor=s.noise_floor,
        scale=scale,
    )


def judge(
    cand: RunResult,
    ref: RunResult,
    timed_against: RunResult | None,
    matrix: Matrix,
    results: dict[str, RunResult],
) -> list[rules.Verdict]:
    s = matrix.settings
    name = cand.spec.name
    if not ref.ok:
        return [
            rules.Verdict(
                name,
                ref.spec.name,
                "fingerprint",
                rules.NOT_APPLICABLE,
                f"reference run {ref.spec.name} did not finish",
            )
        ]
    out = [
        rules.fingerprint_rule(
            name,
            ref.spec.name,
            fp.differences(ref.fingerprint(), cand.fingerprint(), s.vary),
            s.vary,
        )
    ]
    rule = accuracy_rule(cand, ref)
    if out[0].status == rules.REFUSED:
        out.append(
            rules.Verdict(
                name, ref.spec.name, rule, rules.REFUSED, "not compared: the fingerprint differs"
            )
        )
    elif rule == "deterministic":
        out.append(rules.deterministic(name, ref.spec.name, ref.curve(), cand.curve()))
    elif rule == "layout":
        out.append(rules.layout(name, ref.spec.name, ref.curve(), cand.curve(), s.layout_tol))
    else:
        out.append(
            rules.approximate(
                name,
                ref.spec.name,
                ref.curve(),
                cand.curve(),
                rtol=s.rtol,
                mean_rtol=s.mean_rtol,
                late_window=s.late_window,
                late_growth=s.late_growth,
                grad_norm_rtol=s.grad_norm_rtol,
            )
        )
    if out[0].status != rules.REFUSED:
        banded = noise_verdict(cand, ref, results, matrix)
        if banded is not None:
            out.append(banded)
    if timed_against is not None and timed_against.ok and timed_against is not cand:
        out.append(speed_verdict(cand, timed_against, matrix))
    return out


def verdict_cell(result: RunResult, verdicts: list[rules.Verdict], baseline: str) -> str:
    if result.outcome is None or not result.ok:
        return f"run failed: {(result.outcome.error if result.outcome else 'not run') or ''}"[:120]
    if result.spec.name == baseline:
        return "baseline"
    if result.spec.perturb:
        return f"{result.spec.perturb} rerun of {result.spec.rerun_of}"
    if not result.spec.judged:
        return "reference row"
    mine = [v for v in verdicts if v.candidate == result.spec.name]
    if len(mine) == 1 and mine[0].status == rules.NOT_APPLICABLE:
        return f"not compared: {mine[0].detail}"
    refused = [v for v in mine if v.status == rules.REFUSED and v.rule == "fingerprint"]
    if refused:
        return "REFUSED (fingerprint)"
    accuracy = [v for v in mine if v.rule not in ("fingerprint", "performance", "noise")]
    if not accuracy:
        return "; ".join(f"{v.rule}: {v.status}" for v in mine) or "-"
    head = accuracy[0]
    cell = (
        f"{'pass' if head.status == rules.PASS else head.status.upper()} "
        f"{head.rule} vs {head.baseline}"
    )
    if any(v.rule == "noise" and v.status == rules.FAIL for v in mine):
        cell += "; OUTSIDE the rounding band"
    if any(v.rule == "performance" and v.status == rules.FAIL for v in mine):
        cell += "; SLOWER"
    return cell


def noise_cell(result: RunResult, verdicts: list[rules.Verdict]) -> str | None:
    """Table 2's rounding-band column: a candidate's place in its reference's band, or what a
    perturbed rerun is; None for a run without either."""
    if result.spec.perturb:
        return f"{result.spec.perturb} rerun"
    mine = [v for v in verdicts if v.candidate == result.spec.name and v.rule == "noise"]
    return noise.band_cell(mine[0]) if mine else None


def _run_entry(result: RunResult, warmup: int) -> dict[str, Any]:
    curve = result.curve()
    outcome = result.outcome
    return {
        "name": result.spec.name,
        "device": result.device,
        "emulated": result.emulated,
        "options": result.spec.options,
        "config_hash": outcome.config_hash if outcome else None,
        "fingerprint": result.fingerprint() if result.metrics else {},
        "status": outcome.status if outcome else "failed",
        "error": outcome.error if outcome else "not run",
        "wall_s": outcome.wall_s if outcome else 0.0,
        "command": outcome.command if outcome else [],
        "metrics_path": f"runs/{result.spec.name}/metrics.json",
        "steps": [
            {"iteration": i, "loss": loss, "grad_norm": g, "step_time_s": t}
            for i, loss, g, t in zip(
                curve.iterations, curve.losses, curve.grad_norms, curve.step_times, strict=True
            )
        ],
        "perf": perf_record(result, warmup),
        "lambada": result.lambada,
        "reference": result.spec.reference,
        "kind": result.spec.kind,
        "hardware": result.spec.hardware,
        "imported_from": result.provenance,
        "notes": result.notes,
    }


def _table_row(
    result: RunResult, entry: dict[str, Any], cell: str, band: str | None = None
) -> dict[str, Any]:
    perf = entry["perf"] or {}
    summary = (result.metrics or {}).get("summary", {})
    args = result.arguments or {k.replace("-", "_"): v for k, v in result.spec.options.items()}
    world = (result.metrics or {}).get("config", {}).get("world_size")
    return {
        "name": result.spec.name,
        "device": result.device or "/".join(result.spec.devices),
        "hardware": result.spec.hardware,
        "emulated": result.emulated,
        "layout": table2.layout_of(
            {
                **args,
                "data_parallel_size": (result.metrics or {})
                .get("config", {})
                .get("data_parallel_size"),
            },
            world,
        ),
        "precision": table2.precision_of(args),
        "first_loss": summary.get("first_lm_loss"),
        "last_loss": summary.get("last_lm_loss"),
        "s_per_step": perf.get("median_s_per_step"),
        "s_per_step_ci95": perf.get("ci95_s_per_step"),
        "tokens_per_s": perf.get("tokens_per_s"),
        "mfu": perf.get("mfu"),
        "mfu_ci95": perf.get("ci95_mfu"),
        "peak_understated": perf.get("peak_understated", False),
        "peak_allocated_mib": perf.get("peak_allocated_mib"),
        "peak_rss_mib": perf.get("peak_rss_mib"),
        "cloze_set": table2.cloze_set(result.lambada.get("data")) if result.lambada else None,
        "cloze_accuracy": (result.lambada or {}).get("accuracy"),
        "cloze_nll": (result.lambada or {}).get("target_nll"),
        "noise_band": band,
        "verdict": cell,
    }


#: How many times a slowdown is re-timed, both runs back to back, before it is called one.
CONFIRM_ROUNDS = 1


def confirm_slowdown(
    verdict: rules.Verdict,
    results: dict[str, RunResult],
    matrix: Matrix,
    out_dir: Path,
    echo: TextIO,
) -> rules.Verdict:
    """A speed ``fail`` between two runs trained here is re-timed: both are trained again back to
    back (reference first, no checkpoint, in ``runs/<name>/retime``) and the slowdown stands only
    if it shows again: their medians differ beyond the threshold. Runs timed minutes apart on a
    shared machine can differ by more than any threshold; two runs timed one right after the other
    share the machine's load."""
    if verdict.status != rules.FAIL:
        return verdict
    cand, other = results[verdict.candidate], results[verdict.baseline]
    if cand.spec.kind != "train" or other.spec.kind != "train":
        return verdict
    s = matrix.settings
    session = uuid.uuid4().hex[:12]
    for _ in range(CONFIRM_ROUNDS):
        echo.write(
            f" [compare] {cand.spec.name}: slower than {other.spec.name}; "
            "timing both again, back to back\n"
        )
        retimed = {}
        for run in (other, cand):
            run_dir = out_dir / "runs" / run.spec.name / "retime"
            (run_dir / "run.json").unlink(missing_ok=True)
            outcome = runner.execute(
                run.spec,
                run.device,
                run_dir,
                corpus_dir=out_dir / "corpus",
                timeout_s=run.spec.timeout_s or s.timeout_s,
                rerun_index=2,
                checkpoint=False,
                echo=echo,
                session=session,
            )
            metrics = runner.read_json(run_dir / "metrics.json") if outcome.status == "ok" else None
            if metrics is None:
                return verdict  # the re-timing failed: the first timing stands
            retimed[run.spec.name] = RunResult(run.spec, run.device, outcome, metrics)
        again = speed_verdict(retimed[cand.spec.name], retimed[other.spec.name], matrix)
        base_t, cand_t = (
            rules.step_time_stats(retimed[r.spec.name].curve().step_times, s.warmup_steps)
            for r in (other, cand)
        )
        # confirmed when the medians of the back-to-back pair differ beyond the threshold (one
        # loaded stretch widens an interval; the medians of two neighbouring runs still show it)
        ratio = cand_t.median / base_t.median if base_t and cand_t and base_t.median > 0 else 0.0
        if ratio <= 1 + s.perf_threshold:
            return rules.Verdict(
                verdict.candidate,
                verdict.baseline,
                "performance",
                rules.PASS,
                f"not confirmed: first timing {verdict.detail}; "
                f"timed again back to back: {again.detail}",
                verdict.tolerance,
            )
        verdict = rules.Verdict(
            verdict.candidate,
            verdict.baseline,
            "performance",
            rules.FAIL,
            f"{verdict.detail}; confirmed back to back (medians {ratio:.2f}x): {again.detail}",
            verdict.tolerance,
        )
    return verdict


def _datasheet_peak(result: RunResult) -> None:
    """An imported run without a peak of its own (a Megatron-LM log or event folder) gets the
    datasheet peak of the GPU its ``hardware`` label names (:mod:`.datasheet`), per device,
    times its world size; the MFU column then reads against it."""
    summary = result.metrics.setdefault("summary", {})
    if summary.get("peak") or result.emulated:
        return
    args = result.arguments
    found = datasheet.peak(result.spec.hardware, _precision(args))
    if found is None:
        return
    tflops, detail = found
    world = result.metrics.get("config", {}).get("world_size") or args.get("world_size") or 1
    summary["peak"] = {"tflops": tflops, "source": "datasheet", "detail": detail}
    summary["peak_devices"] = int(world)


def import_run(spec: RunSpec, echo: TextIO) -> RunResult:
    """An imported run (:mod:`.imports`), or a failed one whose error names the file and line."""
    try:
        imported = imports.load(str(spec.path), spec.import_run)
    except imports.ImportedRunError as exc:
        echo.write(f" [compare] {spec.name}: FAILED to import ({exc})\n")
        return RunResult(
            spec,
            spec.devices[0] if spec.devices else None,
            runner.Outcome("failed", str(exc), 0.0, [], ""),
        )
    device = spec.devices[0] if spec.devices else imported.device
    if device is None:
        error = (
            f"{spec.path}: the file does not say which device ran it: "
            "set device = ... in the matrix"
        )
        echo.write(f" [compare] {spec.name}: FAILED to import ({error})\n")
        return RunResult(spec, None, runner.Outcome("failed", error, 0.0, [], ""))
    result = RunResult(
        spec,
        device,
        runner.Outcome("imported", None, 0.0, [], imported.provenance.get("sha256") or ""),
        metrics=imported.metrics,
        provenance=imported.provenance,
    )
    _datasheet_peak(result)
    if imported.device and imported.device != device:
        result.notes.append(f"the file says device {imported.device}; the matrix says {device}")
    if imported.emulated and not device_facts.emulated(device):
        result.notes.append("the file says its run was emulated")
    echo.write(
        f" [compare] {spec.name}: imported {imported.provenance['kind']} {spec.path} ({device})\n"
    )
    return result


def build_report(out_dir: Path, echo: TextIO) -> Path | None:
    """``reports.build_report([out_dir], out_dir / "report.html")`` when the reports package is
    importable; otherwise say so (nothing else is lost: results.json is already written)."""
    try:  # through sys.modules, so a stand-in module (tests) or a missing one is what is used
        reports = importlib.import_module("megatron_npu.reports")
    except ImportError:
        echo.write(
            " [compare] no report.html: the `reports` package is not importable here "
            "(results.json and table2.md are written)\n"
        )
        return None
    try:
        path = Path(reports.build_report([out_dir], out_dir / "report.html"))
    except Exception as exc:  # the comparison is done; a report failure must not hide it
        echo.write(f" [compare] report.html failed: {type(exc).__name__}: {exc}\n")
        return None
    echo.write(f" [compare] report: {path}\n")
    return path


def run_compare(
    matrix: Matrix, out_dir: Path, *, argv: list[str] | None = None, echo: TextIO = sys.stdout
) -> tuple[dict[str, Any], int]:
    """Run, judge and write one comparison; returns (results document, exit status)."""
    s = matrix.settings
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for note in matrix.notes:
        echo.write(f" [compare] {note}\n")
    results: dict[str, RunResult] = {}
    skipped: list[dict[str, str]] = []
    session = uuid.uuid4().hex[:12]
    for spec in matrix.runs:
        if spec.kind == "import":
            results[spec.name] = import_run(spec, echo)
            continue
        device = runner.resolve_device(spec)
        if device is None:
            reason = f"none of its devices ({', '.join(spec.devices)}) is available here"
            if spec.optional:
                echo.write(f" [compare] {spec.name}: skipped, {reason}\n")
                skipped.append({"name": spec.name, "reason": reason})
                continue
            results[spec.name] = RunResult(
                spec, None, runner.Outcome("failed", reason, 0.0, [], "")
            )
            continue
        run_dir = out_dir / "runs" / spec.name
        if spec.kind == "script":
            outcome = runner.execute_script(
                spec,
                device,
                run_dir,
                timeout_s=spec.timeout_s or s.timeout_s,
                echo=echo,
                session=session,
            )
        else:
            outcome = runner.execute(
                spec,
                device,
                run_dir,
                corpus_dir=out_dir / "corpus",
                timeout_s=spec.timeout_s or s.timeout_s,
                rerun_index=1 if spec.rerun_of else 0,
                checkpoint=s.lambada,
                echo=echo,
                session=session,
            )
        result = RunResult(spec, device, outcome)
        if outcome.status in ("ok", "cached"):
            result.metrics = runner.read_json(run_dir / "metrics.json")
            if result.metrics is None:
                outcome.status, outcome.error = "failed", "metrics.json is missing or unreadable"
        else:
            echo.write(f" [compare] {spec.name}: FAILED ({outcome.error})\n")
        if s.lambada and result.ok and spec.kind == "train":
            result.lambada = outcome.lambada
            if result.lambada is None:
                result.lambada, why = runner.evaluate_lambada(
                    spec, device, run_dir, s.lambada_data, timeout_s=s.timeout_s, echo=echo
                )
                if why:
                    result.notes.append(f"LAMBADA evaluation failed: {why}")
                    echo.write(f" [compare] {spec.name}: LAMBADA evaluation failed ({why})\n")
        results[spec.name] = result
    base = results.get(s.baseline)
    verdicts: list[rules.Verdict] = []
    for result in results.values():
        if not result.spec.judged or not result.ok or base is None:
            continue
        other = results.get(speed_reference(result, results, s.baseline))
        verdicts += judge(result, results[result.spec.reference], other, matrix, results)
    verdicts = [
        confirm_slowdown(v, results, matrix, out_dir, echo) if v.rule == "performance" else v
        for v in verdicts
    ]
    entries = [_run_entry(r, s.warmup_steps) for r in results.values()]
    rows = [
        _table_row(r, e, verdict_cell(r, verdicts, s.baseline), noise_cell(r, verdicts))
        for r, e in zip(results.values(), entries, strict=True)
    ]
    document = results_mod.document(
        matrix=matrix.source,
        baseline=s.baseline,
        runs=entries,
        verdicts=[v.as_dict() for v in verdicts],
        table2=rows,
        skipped=skipped,
        notes=list(matrix.notes),
        argv=argv,
    )
    title = f"Table 2: {matrix.source} matrix, baseline {s.baseline}"
    text = table2.markdown(rows, title)
    results_path, table_path = results_mod.write(out_dir, document, text)
    echo.write("\n" + text + "\n")
    for v in verdicts:
        echo.write(f" {v.candidate:<22} {v.rule:<13} {v.status:<14} {v.detail}\n")
    for item in skipped:
        echo.write(f" {item['name']:<22} skipped: {item['reason']}\n")
    wall = time.perf_counter() - started
    echo.write(
        f"\n [compare] wrote {results_path} and {table_path} ({len(results)} runs, {wall:.0f} s)\n"
    )
    build_report(out_dir, echo)
    bad_runs = any(not r.ok for r in results.values())
    bad_verdicts = any(v.status in (rules.FAIL, rules.REFUSED) for v in verdicts)
    return document, 1 if bad_runs or bad_verdicts else 0


def add_arguments(parser) -> None:
    parser.add_argument(
        "matrix", nargs="?", default=None, help="matrix TOML (default: the shipped default matrix)"
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )


def main(args) -> int:
    from megatron_npu.compare.matrix import MatrixError, load

    try:
        matrix = load(args.matrix)
    except MatrixError as exc:
        print(f"megatron-npu compare: {exc}", file=sys.stderr)
        return 2
    try:
        _, status = run_compare(matrix, Path(args.out), argv=sys.argv)
    except OSError as exc:
        print(f"megatron-npu compare: {exc}", file=sys.stderr)
        return 2
    return status
