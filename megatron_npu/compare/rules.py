"""The verdict rules, each a pure function of curves (so tests drive them with synthetic data).

* ``fingerprint`` -- the two runs are the same model on the same data (:mod:`.fingerprint`);
  otherwise the candidate is *refused* and the differing fields are named.
* ``deterministic`` -- the same configuration run twice: losses and grad norms bitwise equal.
* ``layout`` -- an fp32 run in another parallel layout of the same model: every step's loss within
  ``layout_tol`` (relative, default 1e-5) of the reference layout's.
* ``approximate`` -- across devices or precisions, the field's GPU-vs-NPU alignment criteria:
  (a) *every* step's loss within ``rtol`` (relative, default 2 %: MindSpeed-LLM's CI holds a
  port's loss to 2 % at every step -- every step, not "any" step: megatron-core 0.16's own check
  passes a 50-step curve when one step is close; Megatron's golden-value figure for its own
  reruns is 5 %); (b) the mean relative loss error below ``mean_rtol`` (1 %: Huawei's porting
  guide calls a mean relative error above 1 % "not aligned"); (c) no late divergence: over the
  last ``late_window`` steps, the mean relative error stays below ``mean_rtol`` and its
  least-squares trend, projected over the window, grows by less than ``late_growth`` (1 %);
  (d) every step's grad norm within ``grad_norm_rtol`` (10 %, MindSpeed-LLM's CI).
* ``noise`` -- beside the fixed thresholds, where the matrix has perturbed reruns of the
  reference: every step inside the band that rounding alone moves the reference by
  (:mod:`.noise`).
* ``performance`` -- like for like only (:func:`speed_mismatch`): a candidate is timed against a
  run of the same precision, parallel layout and sequence/batch shape on another device of the
  same class or another code path on the same device, or against the run the matrix names in
  ``speed_reference``; any other pair is ``not-applicable`` with the reason (a bf16 and an fp32
  run, a GPU and a CPU, a rerun of the very same configuration). Emulated figures are never
  judged (:data:`EMULATED_SPEED`). Median s/step after ``warmup_steps`` with a 95 % bootstrap
  confidence interval; the candidate fails when it is slower by more than ``perf_threshold``
  (5 %, MindSpeed-LLM's CI) at that confidence: the low end of its interval lies more than the
  threshold above the high end of the reference's (a rerun of the same code on a busy VM can
  differ by 20 % in median with narrow intervals; that is not called a slowdown). The same pair
  fails when the candidate's peak memory (the same measure on both: allocator or RSS) exceeds
  the reference's by more than ``memory_threshold`` (10 %, MindSpeed-LLM's CI).

Relative error of a step is ``|candidate - reference| / |reference|``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from megatron_npu.devices.facts import known

RULES = ("fingerprint", "deterministic", "layout", "approximate", "noise", "performance")
#: the default thresholds (module docstring: where each comes from); a matrix sets its own
RTOL, MEAN_RTOL, GRAD_NORM_RTOL = 0.02, 0.01, 0.10
LATE_WINDOW, LATE_GROWTH = 10, 0.01
PERF_THRESHOLD, MEMORY_THRESHOLD = 0.05, 0.10
PASS, FAIL, REFUSED, NOT_APPLICABLE = "pass", "fail", "refused", "not-applicable"
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass
class Verdict:
    candidate: str
    baseline: str
    rule: str
    status: str
    detail: str
    tolerance: dict[str, Any] = field(default_factory=dict)
    per_step: dict[str, list] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Curve:
    """One run's per-step series (losses may hold None for a skipped step)."""

    iterations: list[int]
    losses: list[float | None]
    grad_norms: list[float | None]
    step_times: list[float]


def relative_errors(reference: Sequence[float], candidate: Sequence[float]) -> np.ndarray:
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    return np.abs(cand - ref) / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)


def _aligned(ref: Curve, cand: Curve) -> tuple[list[int], list[float], list[float]] | str:
    """Steps both runs have a loss for, or a reason they cannot be lined up."""
    if ref.iterations != cand.iterations:
        return (
            f"the runs have different steps ({len(ref.iterations)} vs {len(cand.iterations)}, "
            f"{ref.iterations[:1]}..{ref.iterations[-1:]} vs "
            f"{cand.iterations[:1]}..{cand.iterations[-1:]})"
        )
    pairs = [
        (i, r, c)
        for i, r, c in zip(ref.iterations, ref.losses, cand.losses, strict=True)
        if r is not None and c is not None
    ]
    if not pairs:
        return "no step has a loss in both runs"
    its, r, c = zip(*pairs, strict=True)
    return list(its), list(r), list(c)


def fingerprint_rule(
    name: str, reference: str, diffs: list[tuple[str, Any, Any]], vary: Sequence[str]
) -> Verdict:
    tol = {"vary": list(vary)}
    if not diffs:
        return Verdict(
            name,
            reference,
            "fingerprint",
            PASS,
            "same model shape, padded vocab, data, seed, initial weights and tokenizer",
            tol,
        )
    listed = ", ".join(f"{f} ({a!r} vs {b!r})" for f, a, b in diffs)
    return Verdict(
        name,
        reference,
        "fingerprint",
        REFUSED,
        f"refused: differs from {reference} on {listed}; the matrix does not vary "
        f"{'this field' if len(diffs) == 1 else 'these fields'} "
        "(align them, or list them in [compare] vary)",
        tol,
    )


def deterministic(name: str, reference: str, ref: Curve, cand: Curve) -> Verdict:
    tol = {"losses": "bitwise", "grad_norms": "bitwise"}
    if ref.iterations != cand.iterations:
        return Verdict(
            name,
            reference,
            "deterministic",
            FAIL,
            f"different steps: {len(ref.iterations)} vs {len(cand.iterations)}",
            tol,
        )
    loss_diff = [
        i for i, a, b in zip(ref.iterations, ref.losses, cand.losses, strict=True) if a != b
    ]
    norm_diff = [
        i for i, a, b in zip(ref.iterations, ref.grad_norms, cand.grad_norms, strict=True) if a != b
    ]
    per_step = {
        "iteration": list(ref.iterations),
        "rel_diff": _rel_or_zero(ref.losses, cand.losses),
    }
    if not loss_diff and not norm_diff:
        return Verdict(
            name,
            reference,
            "deterministic",
            PASS,
            f"{len(ref.iterations)} steps: losses and grad norms bitwise identical",
            tol,
            per_step,
        )
    parts = []
    if loss_diff:
        parts.append(f"loss differs at {len(loss_diff)} step(s), first {loss_diff[0]}")
    if norm_diff:
        parts.append(f"grad norm differs at {len(norm_diff)} step(s), first {norm_diff[0]}")
    return Verdict(name, reference, "deterministic", FAIL, "; ".join(parts), tol, per_step)


def _rel_or_zero(a: Sequence[float | None], b: Sequence[float | None]) -> list[float | None]:
    return [
        float(relative_errors([x], [y])[0]) if x is not None and y is not None else None
        for x, y in zip(a, b, strict=True)
    ]


def layout(name: str, reference: str, ref: Curve, cand: Curve, tol: float = 1e-5) -> Verdict:
    tolerance = {"per_step_rel": tol}
    lined = _aligned(ref, cand)
    if isinstance(lined, str):
        return Verdict(name, reference, "layout", FAIL, lined, tolerance)
    its, r, c = lined
    err = relative_errors(r, c)
    per_step = {"iteration": its, "rel_diff": err.tolist()}
    worst = int(np.argmax(err))
    if err[worst] <= tol:
        return Verdict(
            name,
            reference,
            "layout",
            PASS,
            f"all {len(its)} steps within {tol:g} (max {err[worst]:.2e} at step {its[worst]})",
            tolerance,
            per_step,
        )
    over = int(np.sum(err > tol))
    return Verdict(
        name,
        reference,
        "layout",
        FAIL,
        f"{over} of {len(its)} steps beyond {tol:g}; max {err[worst]:.2e} at step {its[worst]}",
        tolerance,
        per_step,
    )


def late_trend(errors: np.ndarray, window: int) -> tuple[float, float]:
    """Mean relative error over the last ``window`` steps and its fitted growth over the window."""
    tail = errors[-window:] if window > 0 else errors
    if len(tail) < 2:
        return float(tail.mean()) if len(tail) else 0.0, 0.0
    slope = float(np.polyfit(np.arange(len(tail), dtype=np.float64), tail, 1)[0])
    return float(tail.mean()), slope * (len(tail) - 1)


def approximate(
    name: str,
    reference: str,
    ref: Curve,
    cand: Curve,
    *,
    rtol: float = RTOL,
    mean_rtol: float = MEAN_RTOL,
    late_window: int = LATE_WINDOW,
    late_growth: float = LATE_GROWTH,
    grad_norm_rtol: float = GRAD_NORM_RTOL,
) -> Verdict:
    window = min(late_window, len(ref.iterations))
    tolerance = {
        "rtol": rtol,
        "mean_rtol": mean_rtol,
        "late_window": window,
        "late_growth": late_growth,
        "grad_norm_rtol": grad_norm_rtol,
    }
    lined = _aligned(ref, cand)
    if isinstance(lined, str):
        return Verdict(name, reference, "approximate", FAIL, lined, tolerance)
    its, r, c = lined
    err = relative_errors(r, c)
    per_step = {"iteration": its, "rel_diff": err.tolist()}
    problems = []
    over = np.flatnonzero(err > rtol)
    if len(over):
        problems.append(
            f"{len(over)} of {len(its)} steps beyond {rtol:.0%} "
            f"(first at step {its[over[0]]}: {err[over[0]]:.2%})"
        )
    mean = float(err.mean())
    if mean >= mean_rtol:
        problems.append(f"mean relative error {mean:.2%} >= {mean_rtol:.0%}")
    late_mean, growth = late_trend(err, window)
    if late_mean >= mean_rtol or growth >= late_growth:
        problems.append(
            f"late divergence over the last {window} steps: mean {late_mean:.2%}, "
            f"trend +{growth:.2%} (limits {mean_rtol:.0%} and +{late_growth:.0%})"
        )
    norms = [
        (i, a, b)
        for i, a, b in zip(ref.iterations, ref.grad_norms, cand.grad_norms, strict=True)
        if a is not None and b is not None
    ]
    if norms:
        norm_its = [i for i, _, _ in norms]
        norm_err = relative_errors([a for _, a, _ in norms], [b for _, _, b in norms])
        per_step["grad_norm_iteration"] = norm_its
        per_step["grad_norm_rel_diff"] = norm_err.tolist()
        over = np.flatnonzero(norm_err > grad_norm_rtol)
        if len(over):
            problems.append(
                f"grad norm of {len(over)} of {len(norms)} steps beyond {grad_norm_rtol:.0%} "
                f"(first at step {norm_its[over[0]]}: {norm_err[over[0]]:.2%})"
            )
    summary = (
        f"max {err.max():.2%}, mean {mean:.2%}, "
        f"last {window} steps mean {late_mean:.2%} trend {growth:+.2%}"
    )
    if norms:
        summary += f", grad norm max {float(norm_err.max()):.2%}"
    if problems:
        return Verdict(
            name,
            reference,
            "approximate",
            FAIL,
            "; ".join(problems) + f" ({summary})",
            tolerance,
            per_step,
        )
    return Verdict(
        name,
        reference,
        "approximate",
        PASS,
        f"all {len(its)} steps within {rtol:.0%}: {summary}",
        tolerance,
        per_step,
    )


#: The one rule for emulated rows (``npu-emulated``: the NPU code path run on CPU through the
#: torch_npu emulation): their s/step and tokens/s are shown as measured and marked emulated, but
#: they have no MFU (no NPU peak applies to them) and never a speed verdict.
EMULATED_SPEED = (
    "emulated figures: not NPU performance, never compared for speed and shown without MFU"
)


def mfu_shown(emulated: bool) -> bool:
    """Whether a row gets an MFU figure (:data:`EMULATED_SPEED`)."""
    return not emulated


@dataclass(frozen=True)
class SpeedSetup:
    """What a run's speed depends on besides the code: where it ran and the shape of its work."""

    device: str | None
    emulated: bool
    precision: str
    layout: str
    shape: dict[str, Any]  # seq_length, micro_batch_size, global_batch_size
    hardware: str | None = None


def _speed_class(device: str | None) -> str | None:
    found = known(device)
    return found.speed_class if found is not None else None


def speed_mismatch(
    cand: SpeedSetup, base: SpeedSetup, *, same_configuration: bool = False, explicit: bool = False
) -> str | None:
    """Why ``cand`` may not be timed against ``base`` (None: it may). ``explicit``: the matrix
    named the pair (``speed_reference``), which waives the like-for-like checks but never the
    emulation rule; ``same_configuration``: the same options on the same device (a rerun)."""
    if cand.emulated or base.emulated:
        return EMULATED_SPEED
    if explicit:
        return None
    if same_configuration and cand.device == base.device:
        return "the same configuration on the same device: a rerun, not another code path"
    differs = []
    if cand.precision != base.precision:
        differs.append(f"precision {cand.precision} vs {base.precision}")
    if cand.layout != base.layout:
        differs.append(f"layout {cand.layout} vs {base.layout}")
    for key in sorted(set(cand.shape) | set(base.shape)):
        if cand.shape.get(key) != base.shape.get(key):
            differs.append(f"{key} {cand.shape.get(key)} vs {base.shape.get(key)}")
    # devices of one speed class may be timed against each other; emulated ones have none
    classes = _speed_class(cand.device), _speed_class(base.device)
    if classes[0] != classes[1] or classes[0] is None:
        differs.append(f"device {cand.device} ({classes[0]}) vs {base.device} ({classes[1]})")
    if not differs:
        return None
    return (
        "not like for like: "
        + ", ".join(differs)
        + " (name the pair in speed_reference to time it anyway)"
    )


@dataclass(frozen=True)
class StepTimeStats:
    median: float
    ci95: tuple[float, float]
    samples: int


def step_time_stats(
    times: Sequence[float], warmup: int = 2, *, resamples: int = BOOTSTRAP_RESAMPLES
) -> StepTimeStats | None:
    """Median s/step after ``warmup`` steps, with a percentile-bootstrap 95 % interval (steps
    without a time -- NaN or None, as an imported log may have -- are left out)."""

    def finite(values: list) -> list[float]:
        return [float(t) for t in values if t is not None and np.isfinite(t)]

    steady = np.asarray(finite(list(times)[warmup:]) or finite(list(times)), dtype=np.float64)
    if steady.size == 0:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    medians = np.median(rng.choice(steady, size=(resamples, steady.size), replace=True), axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return StepTimeStats(float(np.median(steady)), (float(lo), float(hi)), int(steady.size))


@dataclass(frozen=True)
class PeakMemory:
    """A run's peak memory in bytes and what measured it (``allocator`` or ``rss``): two runs'
    peaks are compared only when one measure took both."""

    nbytes: int
    measure: str


def performance(
    name: str,
    reference: str,
    base: StepTimeStats | None,
    cand: StepTimeStats | None,
    *,
    mismatch: str | None = None,
    threshold: float = PERF_THRESHOLD,
    base_memory: PeakMemory | None = None,
    cand_memory: PeakMemory | None = None,
    memory_threshold: float = MEMORY_THRESHOLD,
) -> Verdict:
    """``mismatch``: :func:`speed_mismatch`'s reason the pair is not timed (None: it is)."""
    tolerance = {"threshold": threshold, "ci": 0.95, "memory_threshold": memory_threshold}
    if mismatch is not None:
        return Verdict(name, reference, "performance", NOT_APPLICABLE, mismatch, tolerance)
    if base is None or cand is None:
        return Verdict(
            name, reference, "performance", NOT_APPLICABLE, "no step times to compare", tolerance
        )
    ratio = cand.median / base.median if base.median > 0 else float("inf")
    text = (
        f"{cand.median:.4f} s/step [{cand.ci95[0]:.4f}, {cand.ci95[1]:.4f}] vs {base.median:.4f} "
        f"[{base.ci95[0]:.4f}, {base.ci95[1]:.4f}]: {ratio:.2f}x"
    )
    problems = []
    if cand.ci95[0] > base.ci95[1] * (1 + threshold):
        problems.append(f"slower than {reference} beyond {threshold:.0%}")
    memory = (
        base_memory is not None
        and cand_memory is not None
        and base_memory.measure == cand_memory.measure
        and base_memory.nbytes > 0
    )
    if memory:
        mem_ratio = cand_memory.nbytes / base_memory.nbytes
        text += (
            f"; peak memory ({cand_memory.measure}) {cand_memory.nbytes / 2**20:.1f} vs "
            f"{base_memory.nbytes / 2**20:.1f} MiB: {mem_ratio:.2f}x"
        )
        if mem_ratio > 1 + memory_threshold:
            problems.append(f"more peak memory than {reference} beyond {memory_threshold:.0%}")
    if problems:
        return Verdict(
            name, reference, "performance", FAIL, f"{'; '.join(problems)}: {text}", tolerance
        )
    return Verdict(name, reference, "performance", PASS, text, tolerance)
