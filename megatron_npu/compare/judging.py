"""Judging a compare run: the outcome of each run (:class:`RunResult`) and the verdicts of a
candidate against its references -- accuracy by the fingerprint and the rules of :mod:`.rules`,
speed like for like only, and the noise band where the matrix asks for one -- with the cells
Table 2 shows for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_npu.compare import fingerprint as fp
from megatron_npu.compare import noise, rules, runner, table2
from megatron_npu.compare.matrix import LAYOUT_OPTIONS, Matrix, RunSpec
from megatron_npu.devices import facts as device_facts
from megatron_npu.formats.lambada_result import LambadaResult
from megatron_npu.formats.metrics import MetricsFile, RunConfig, Summary
from megatron_npu.training.peak import plausible


@dataclass
class RunResult:
    spec: RunSpec
    device: str | None
    outcome: runner.Outcome | None
    metrics: MetricsFile | None = None
    lambada: LambadaResult | None = None
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
            return bool(self.metrics.config.device_emulated)
        return False

    @property
    def arguments(self) -> dict[str, Any]:
        return self.metrics.config.arguments if self.metrics else {}

    def curve(self) -> rules.Curve:
        steps = self.metrics.steps if self.metrics else []
        return rules.Curve(
            iterations=[s.step for s in steps],
            losses=[None if s.skipped else s.lm_loss for s in steps],
            grad_norms=[s.grad_norm for s in steps],
            step_times=[s.step_time_s for s in steps],
        )

    def fingerprint(self) -> dict[str, Any]:
        return fp.fingerprint(self.metrics.config, self.device) if self.metrics else {}

    def speed_setup(self) -> rules.SpeedSetup:
        args = self.arguments
        config = self.metrics.config if self.metrics else RunConfig(arguments={})
        return rules.SpeedSetup(
            device=self.device,
            emulated=self.emulated,
            precision=precision_of(args),
            layout=table2.layout_of(
                {**args, "data_parallel_size": config.data_parallel_size},
                config.world_size,
            ),
            shape={k: args.get(k) for k in SHAPE_ARGUMENTS},
            hardware=self.spec.hardware,
        )


#: The arguments that set a step's amount of work (with the model shape the fingerprint checks).
SHAPE_ARGUMENTS = ("seq_length", "micro_batch_size", "global_batch_size")


def precision_of(options: dict[str, Any]) -> str:
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
    fp32 = precision_of(cand.spec.options) == precision_of(ref.spec.options) == "fp32"
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
    summary = result.metrics.summary if result.metrics else Summary()
    memory = summary.peak_memory_bytes
    # a metrics file that does not say what its peak measured (``peak_memory_measure``, written
    # since the host allocator peak) measured what its device measures
    device = device_facts.known(result.device)
    measure = summary.peak_memory_measure or (device.memory_measure if device else None)
    if memory is None or measure is None:
        return None
    return rules.PeakMemory(int(memory), measure)


def perf_record(result: RunResult, warmup: int) -> dict[str, Any] | None:
    if not result.metrics:
        return None
    curve = result.curve()
    summary = result.metrics.summary
    if summary.peak_memory_profiled_step is not None:
        warmup = max(warmup, 1)  # the first step ran under the memory profiler: never timed
    stats = rules.step_time_stats(curve.step_times, warmup)
    args = result.arguments
    tokens = (args.get("global_batch_size") or 0) * (args.get("seq_length") or 0)
    flops = summary.model_flops_per_step
    peak = summary.peak
    raw_mfu = mfu_ci95 = None
    if stats and flops and peak and peak.tflops:
        peak_flops = peak.tflops * 1e12 * (summary.peak_devices or 1)
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
        "peak_tflops": peak.tflops if peak else None,
        "peak_source": peak.source if peak else None,
        "peak_understated": rules.mfu_shown(result.emulated)
        and raw_mfu is not None
        and mfu is None,
        "mfu_note": None if rules.mfu_shown(result.emulated) else rules.EMULATED_SPEED,
        "peak_allocated_mib": memory_mib if measure == "allocator" else None,
        "peak_rss_mib": memory_mib if measure == "rss" else _mib(summary.peak_rss_bytes),
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
