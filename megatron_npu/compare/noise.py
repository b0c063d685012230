"""The ``noise`` rule: a candidate judged against how far rounding alone moves its reference.

Fixed thresholds judge noise: a curve with an early grad-norm spike turns plain rounding into
per-cent differences, and a quiet curve hides a real per-cent bug inside 2 %. The yardstick a
careful engineer uses instead is the reference rerun with a rounding-level perturbation
(:data:`ROUNDING`): its initial weights moved by one ulp (``--init-ulp-nudge``), or, on a host
CPU, another OpenMP thread count. Each perturbed rerun's per-step relative deviation from the
reference measures what the configuration amplifies rounding into at that step.

The band of step ``i`` is ``max(floor, factor * E_i)`` where ``E_i`` is the envelope: the largest
deviation of any rounding rerun at any step up to ``i`` (rounding grows chaotically, so one
rerun's deviation at one step can cross zero; its running maximum does not). ``factor``
(default 3) widens it for what two reruns cannot sample; ``floor`` (default 1e-6, relative) is
the least difference ever called a divergence: the scale at which fp32 loss reductions on two
devices may differ before any step has amplified anything. The candidate fails when

* any step's loss, or grad norm, leaves its band, or
* its mean relative loss deviation exceeds ``max(floor, factor * M)``, where ``M`` is the
  largest mean deviation of a rounding rerun (a candidate that sits near the band's edge at every
  step drifts more than rounding does, even though no single step leaves it).

A rerun with another seed (:data:`SCALE`) moves the curve by what the data order and
initialisation do; it is reported as the scale of a real change, never used for the band.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_npu.compare.rules import FAIL, NOT_APPLICABLE, PASS, Curve, Verdict, relative_errors

#: perturbations whose reruns measure rounding (the band); ``seed`` only gives the scale
ROUNDING = ("init-ulp", "init-ulp-down", "threads")
SCALE = "seed"
PERTURBATIONS = (*ROUNDING, SCALE)
#: defaults of the matrix's ``noise_factor`` and ``noise_floor``
FACTOR, FLOOR = 3.0, 1e-6
#: rounding reruns a band needs
MIN_RERUNS = 2


def _deviations(ref: Curve, other: Curve, attr: str) -> dict[int, float]:
    """Per iteration, ``|other - ref| / |ref|`` of ``attr`` where both have a value."""
    out = {}
    for i, a, b in zip(ref.iterations, getattr(ref, attr), getattr(other, attr), strict=False):
        if a is not None and b is not None:
            out[i] = float(relative_errors([a], [b])[0])
    return out


def envelope(iterations: Sequence[int], deviations: Sequence[dict[int, float]]) -> np.ndarray:
    """The running maximum, over steps up to each one, of every rerun's deviation."""
    worst = [max((d.get(i, 0.0) for d in deviations), default=0.0) for i in iterations]
    return np.maximum.accumulate(np.asarray(worst, dtype=np.float64)) if worst else np.zeros(0)


def _banded(
    ref: Curve,
    rerun_devs: list[dict[int, float]],
    cand: Curve,
    attr: str,
    factor: float,
    floor: float,
) -> tuple[list[int], list[float], list[float]]:
    """The steps where ``cand`` has ``attr`` beside the reference, its deviation there and the
    band there (``rerun_devs``: each rounding rerun's deviations of ``attr``)."""
    its = list(ref.iterations)
    edge = dict(
        zip(its, np.maximum(floor, factor * envelope(its, rerun_devs)).tolist(), strict=True)
    )
    mine = _deviations(ref, cand, attr)
    steps = [i for i in its if i in mine]
    return steps, [mine[i] for i in steps], [edge[i] for i in steps]


def _outside(what: str, steps: list[int], devs: list[float], edges: list[float]) -> str | None:
    out = [k for k, (d, e) in enumerate(zip(devs, edges, strict=True)) if d > e]
    if not out:
        return None
    k = out[0]
    return (
        f"{what}{len(out)} of {len(steps)} steps outside the rounding band (first at step "
        f"{steps[k]}: {devs[k]:.3g} against {edges[k]:.3g})"
    )


def noise(
    name: str,
    reference: str,
    ref: Curve,
    reruns: dict[str, Curve],
    cand: Curve,
    *,
    factor: float = FACTOR,
    floor: float = FLOOR,
    scale: Curve | None = None,
) -> Verdict:
    """Judge ``cand`` against ``ref``'s rounding band, measured by ``reruns`` (name -> curve of
    a rounding rerun, at least :data:`MIN_RERUNS`); ``scale``: a rerun with another seed."""
    tolerance: dict = {"factor": factor, "floor": floor, "reruns": sorted(reruns)}
    if len(reruns) < MIN_RERUNS:
        return Verdict(
            name,
            reference,
            "noise",
            NOT_APPLICABLE,
            f"the rounding band needs {MIN_RERUNS} reruns of {reference}; "
            f"{len(reruns)} finished ({', '.join(sorted(reruns)) or 'none'})",
            tolerance,
        )
    if any(c.iterations != ref.iterations for c in (cand, *reruns.values())):
        return Verdict(
            name,
            reference,
            "noise",
            FAIL,
            "the candidate or a rerun has other steps than the reference",
            tolerance,
        )
    loss_devs = [_deviations(ref, c, "losses") for c in reruns.values()]
    steps, devs, edges = _banded(ref, loss_devs, cand, "losses", factor, floor)
    if not steps:
        return Verdict(name, reference, "noise", FAIL, "no step has a loss in both runs", tolerance)
    rerun_means = [float(np.mean(list(d.values()))) if d else 0.0 for d in loss_devs]
    mean_band = tolerance["mean_band"] = max(floor, factor * max(rerun_means))
    per_step: dict[str, list] = {"iteration": steps, "rel_diff": devs, "band": edges}
    problems = [_outside("", steps, devs, edges)]
    mean = float(np.mean(devs))
    if mean > mean_band:
        problems.append(f"mean deviation {mean:.3g} above rounding's {mean_band:.3g}")
    norm_steps, norm_devs, norm_edges = _banded(
        ref,
        [_deviations(ref, c, "grad_norms") for c in reruns.values()],
        cand,
        "grad_norms",
        factor,
        floor,
    )
    if norm_steps:
        per_step.update(
            grad_norm_iteration=norm_steps, grad_norm_rel_diff=norm_devs, grad_norm_band=norm_edges
        )
        problems.append(_outside("grad norm of ", norm_steps, norm_devs, norm_edges))
    problems = [p for p in problems if p]
    widest = max(d / e for d, e in zip(devs, edges, strict=True))
    summary = (
        f"mean deviation {mean:.3g} (rounding's {max(rerun_means):.3g}), at most "
        f"{widest:.2g}x its band; band from {', '.join(sorted(reruns))}"
    )
    if scale is not None:
        scale_dev = _deviations(ref, scale, "losses")
        if scale_dev:
            seed_mean = tolerance["seed_scale"] = float(np.mean(list(scale_dev.values())))
            summary += f"; another seed moves the loss by {seed_mean:.3g} on average"
    if problems:
        return Verdict(
            name,
            reference,
            "noise",
            FAIL,
            "; ".join(problems) + f" ({summary})",
            tolerance,
            per_step,
        )
    return Verdict(
        name, reference, "noise", PASS, f"inside the rounding band: {summary}", tolerance, per_step
    )


def band_cell(verdict: Verdict) -> str:
    """Table 2's rounding-band cell of a candidate: inside (how close to the edge it came) or
    the first step where its loss or grad norm leaves the band."""
    steps = verdict.per_step or {}
    if verdict.status not in (PASS, FAIL) or not steps.get("iteration"):
        return verdict.status
    ratios = {}
    for prefix in ("", "grad_norm_"):
        its = steps.get(f"{prefix}iteration", [])
        for i, d, b in zip(
            its, steps.get(f"{prefix}rel_diff", []), steps.get(f"{prefix}band", []), strict=True
        ):
            ratios[i] = max(ratios.get(i, 0.0), d / b if b > 0 else float("inf"))
    if verdict.status == PASS:
        return f"inside (at most {max(ratios.values()):.2g}x the band)"
    outside = [i for i, r in sorted(ratios.items()) if r > 1]
    if outside:
        return f"OUTSIDE from step {outside[0]} ({ratios[outside[0]]:.3g}x the band)"
    return "OUTSIDE on the mean"
