"""A slowdown between two local runs stands only when re-timing both back to back shows it again."""

from __future__ import annotations

import uuid
from pathlib import Path

from megatron_npu import console
from megatron_npu.compare import rules, runner
from megatron_npu.compare.judging import RunResult, speed_verdict
from megatron_npu.compare.matrix import Matrix
from megatron_npu.formats import FormatError
from megatron_npu.formats.metrics import MetricsFile

#: How many times a slowdown is re-timed, both runs back to back, before it is called one.
CONFIRM_ROUNDS = 1


def confirm_slowdown(
    verdict: rules.Verdict,
    results: dict[str, RunResult],
    matrix: Matrix,
    out_dir: Path,
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
        console.say(
            f" [compare] {cand.spec.name}: slower than {other.spec.name}; "
            "timing both again, back to back"
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
                session=session,
            )
            try:
                if outcome.status != "ok":
                    return verdict  # the re-timing failed: the first timing stands
                metrics = MetricsFile.read(run_dir / "metrics.json")
            except FormatError:
                return verdict
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
