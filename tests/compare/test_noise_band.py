"""The noise rule on synthetic curves: the band is the running envelope of the rounding reruns'
deviations, widened by the factor, never below the floor; a candidate leaves it per step, on
the mean or by its grad norm; Table 2's cell says where."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_npu.compare import noise, rules


def curve(losses, norms=None) -> rules.Curve:
    its = list(range(1, len(losses) + 1))
    return rules.Curve(its, list(losses), list(norms or [1.0] * len(losses)), [0.1] * len(losses))


REF = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]


def moved(rel) -> list[float]:
    return [r * (1 + d) for r, d in zip(REF, rel, strict=True)]


#: two reruns: rounding grows from 1e-7 to 1e-4 (the spike at step 3), one crosses back at step 5
RERUNS = {
    "up": curve(moved([1e-7, 2e-7, 1e-4, 5e-5, 1e-8, 6e-5])),
    "down": curve(moved([-1e-7, -3e-7, -2e-5, -8e-5, -2e-8, -4e-5])),
}


def test_the_band_is_the_running_envelope_times_the_factor_above_the_floor():
    verdict = noise.noise("c", "ref", curve(REF), RERUNS, curve(REF), factor=3.0, floor=1e-6)
    assert verdict.status == rules.PASS, verdict.detail
    band = np.array(verdict.per_step["band"])
    # steps 1-2: 3 x 1e-7 and 3 x 3e-7 (below 1e-6: the floor); from the spike on, 3 x 1e-4,
    # and it stays there at step 5, where both reruns happen to come back near zero
    np.testing.assert_allclose(band, [1e-6, 1e-6, 3e-4, 3e-4, 3e-4, 3e-4], rtol=1e-6)
    assert verdict.tolerance["reruns"] == ["down", "up"]


def test_a_candidate_beyond_the_band_fails_at_its_first_step_outside():
    cand = curve(moved([5e-7, 2e-6, 1e-4, 1e-4, 1e-4, 1e-4]))
    verdict = noise.noise("c", "ref", curve(REF), RERUNS, cand, factor=3.0, floor=1e-6)
    assert verdict.status == rules.FAIL
    assert "1 of 6 steps outside the rounding band (first at step 2" in verdict.detail
    assert noise.band_cell(verdict).startswith("OUTSIDE from step 2")


def test_a_candidate_near_the_edge_at_every_step_fails_on_the_mean():
    # every step inside the band, but its mean deviation beyond 3x the noisiest rerun's mean
    cand = curve(moved([9e-7, 9e-7, 2.9e-4, 2.9e-4, 2.9e-4, 2.9e-4]))
    verdict = noise.noise("c", "ref", curve(REF), RERUNS, cand, factor=3.0, floor=1e-6)
    assert verdict.status == rules.FAIL and "mean deviation" in verdict.detail, verdict.detail
    assert "steps outside" not in verdict.detail
    assert noise.band_cell(verdict) == "OUTSIDE on the mean"


def test_the_grad_norm_has_its_own_band():
    reruns = {
        k: rules.Curve(c.iterations, c.losses, [1.0, 1.0 + 1e-6, 1.0, 1.0, 1.0, 1.0], c.step_times)
        for k, c in RERUNS.items()
    }
    cand = rules.Curve(list(range(1, 7)), REF, [1.0, 1.0, 1.01, 1.0, 1.0, 1.0], [0.1] * 6)
    verdict = noise.noise("c", "ref", curve(REF), reruns, cand)
    assert verdict.status == rules.FAIL
    assert "grad norm of 1 of 6 steps outside the rounding band (first at step 3" in verdict.detail
    assert len(verdict.per_step["grad_norm_band"]) == 6


def test_one_rerun_is_not_a_band_and_a_seed_rerun_gives_only_the_scale():
    one = noise.noise("c", "ref", curve(REF), {"up": RERUNS["up"]}, curve(REF))
    assert one.status == rules.NOT_APPLICABLE and "needs 2 reruns" in one.detail
    seed = curve(moved([0.01] * 6))
    verdict = noise.noise("c", "ref", curve(REF), RERUNS, curve(REF), scale=seed)
    assert verdict.status == rules.PASS
    assert verdict.tolerance["seed_scale"] == pytest.approx(0.01)
    assert verdict.per_step["band"][-1] == pytest.approx(3e-4)  # the seed did not widen it


def test_a_candidate_with_other_steps_is_not_judged_inside():
    verdict = noise.noise("c", "ref", curve(REF), RERUNS, curve(REF[:4]))
    assert verdict.status == rules.FAIL and "other steps" in verdict.detail


def test_a_threads_rerun_changes_the_host_thread_count_and_only_on_the_host(monkeypatch):
    from types import SimpleNamespace

    from megatron_npu import devices
    from megatron_npu.compare import matrix as m
    from megatron_npu.compare import runner

    spec = m.RunSpec("t", ("cpu",), {}, perturb="threads", rerun_of="ref")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert runner.perturbation_env(spec, "cpu") == {"OMP_NUM_THREADS": "2"}
    assert runner.perturbation_env(spec, "npu-emulated") == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's count: the rerun takes one thread
    assert runner.perturbation_env(spec, "cpu") == {"OMP_NUM_THREADS": "1"}
    assert runner.perturbation_env(m.RunSpec("u", ("cpu",), {}, perturb="init-ulp"), "cpu") == {}
    # the environment is part of the run's identity: a cached plain rerun is not reused for it
    assert runner.config_hash(spec, "cpu", 1, False) != runner.config_hash(
        spec, "cpu", 1, False, {"OMP_NUM_THREADS": "1"}
    )
    monkeypatch.setattr(devices, "make", lambda name: SimpleNamespace(torch_type="cuda"))
    with pytest.raises(ValueError, match='perturb = "threads" changes the host CPU'):
        runner.perturbation_env(spec, "cuda")


def test_a_threads_reruns_record_carries_the_thread_count_it_ran_with(tmp_path, monkeypatch):
    """run.json keeps the command with the environment the rerun changed, so that the line
    reproduces the run and locate can tell it from a plain one."""
    from megatron_npu.compare import matrix as m
    from megatron_npu.compare import runner
    from megatron_npu.formats.run_record import RunRecord
    from megatron_npu.locate.command import LocateError, side_from_compare

    launched = []
    monkeypatch.setattr(
        runner, "stream", lambda cmd, log, timeout, env: (launched.append(env) or 1, [], 0.1)
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = m.RunSpec("t", ("cpu",), {"num-layers": 2}, perturb="threads", rerun_of="ref")
    run_dir = tmp_path / "runs" / "t"
    outcome = runner.execute(spec, "cpu", run_dir, corpus_dir=tmp_path, timeout_s=5)
    assert launched[0]["OMP_NUM_THREADS"] == "2"
    recorded = RunRecord.read(run_dir / "run.json").command
    assert recorded == outcome.command
    assert recorded[:2] == ["env", "OMP_NUM_THREADS=2"] and recorded[4:6] == [
        "megatron_npu.cli",
        "train",
    ]
    (run_dir / "metrics.json").write_text('{"steps": []}')
    with pytest.raises(LocateError, match=r"'t' ran with OMP_NUM_THREADS=2 \(a perturbed rerun\)"):
        side_from_compare(tmp_path, "t")


def test_a_script_runs_ulp_rerun_passes_its_nudge_to_run_script():
    """A train run's rerun takes ``--init-ulp-nudge``; a script run's the same ulps through the
    environment run_script reads."""
    from megatron_npu.compare import matrix as m
    from megatron_npu.compare import runner
    from megatron_npu.training import weight_nudge

    def script(perturb):
        return m.RunSpec("s", ("cpu",), {}, kind="script", path="p.py", perturb=perturb)

    assert runner.perturbation_env(script("init-ulp"), "cpu") == {weight_nudge.ENV: "1"}
    assert runner.perturbation_env(script("init-ulp-down"), "npu") == {weight_nudge.ENV: "-1"}
    assert runner.perturbation_env(script("seed"), "cpu") == {}
    assert runner.perturbation_env(script(None), "cpu") == {}
