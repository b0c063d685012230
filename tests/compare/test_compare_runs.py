"""compare on real tiny training runs: a rerun is bitwise equal, a learning rate 10 % higher fails
the approximate rule, a seed mismatch is refused naming the field, a failing and a killed run are
reported while the others complete, and a second invocation reuses the finished runs."""

from __future__ import annotations

import pytest

from megatron_npu.compare import command
from megatron_npu.compare import matrix as m

pytestmark = pytest.mark.slow

MATRIX = """
[compare]
baseline = "base"

[defaults]
num-layers = 1
hidden-size = 32
num-attention-heads = 2
seq-length = 64
micro-batch-size = 4
global-batch-size = 4
train-iters = 20
lr = 5e-3
attention-dropout = 0.0
hidden-dropout = 0.0
log-interval = 10
peak-tflops = 1.0

[[run]]
name = "base"
device = "cpu"

[[run]]
name = "base-rerun"
rerun_of = "base"

[[run]]
name = "lr-plus-10pct"       # the planted drift
device = "cpu"
options = { lr = 5.5e-3 }

[[run]]
name = "other-seed"          # not declared in [compare] vary: refused
device = "cpu"
options = { seed = 4321 }

[[run]]
name = "bad-data"            # fails at the launcher's input checks (the matrix's own check
device = "cpu"                # takes the options; the data file is missing at run time)
options = { data-path = ["/nonexistent/corpus_text_document"], tokenizer-type = "ByteLevel" }

[[run]]
name = "killed"              # killed at its timeout
device = "cpu"
timeout_s = 2
"""


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")  # one rank per run on a shared CI machine
    try:
        folder = tmp_path_factory.mktemp("compare")
        path = folder / "matrix.toml"
        path.write_text(MATRIX)
        matrix = m.load(path)
        first = command.run_compare(matrix, folder / "out")
        second = command.run_compare(
            m.load(path).__class__(
                source=matrix.source,
                settings=matrix.settings,
                runs=tuple(r for r in matrix.runs if r.name in ("base", "base-rerun")),
                notes=matrix.notes,
            ),
            folder / "out",
        )
    finally:
        mp.undo()
    return first, second


def _verdict(document, candidate, rule):
    return next(
        v for v in document["verdicts"] if v["candidate"] == candidate and v["rule"] == rule
    )


def test_rerun_is_bitwise_equal(compared):
    (document, _), _ = compared
    verdict = _verdict(document, "base-rerun", "deterministic")
    assert verdict["status"] == "pass", verdict["detail"]
    runs = {r["name"]: r for r in document["runs"]}
    assert [s["loss"] for s in runs["base"]["steps"]] == [
        s["loss"] for s in runs["base-rerun"]["steps"]
    ]
    assert len(runs["base"]["steps"]) == 20


def test_learning_rate_ten_percent_higher_fails_approximate(compared):
    (document, _), _ = compared
    verdict = _verdict(document, "lr-plus-10pct", "approximate")
    assert verdict["status"] == "fail", verdict["detail"]
    assert _verdict(document, "lr-plus-10pct", "fingerprint")["status"] == "pass"


def test_seed_mismatch_is_refused_naming_the_field(compared):
    (document, _), _ = compared
    verdict = _verdict(document, "other-seed", "fingerprint")
    assert verdict["status"] == "refused"
    assert "seed (1234 vs 4321)" in verdict["detail"]
    assert _verdict(document, "other-seed", "approximate")["status"] == "refused"
    row = next(r for r in document["table2"] if r["name"] == "other-seed")
    assert row["verdict"] == "REFUSED (fingerprint)"


def test_failed_and_killed_runs_are_reported_and_the_rest_complete(compared):
    (document, status), _ = compared
    runs = {r["name"]: r for r in document["runs"]}
    assert status == 1
    assert runs["bad-data"]["status"] == "failed" and "exit code 2" in runs["bad-data"]["error"]
    assert "/nonexistent/corpus_text_document" in runs["bad-data"]["error"]
    assert runs["killed"]["status"] == "failed" and "timeout" in runs["killed"]["error"]
    assert all(
        runs[n]["status"] == "ok" for n in ("base", "base-rerun", "lr-plus-10pct", "other-seed")
    )
    perf = runs["base"]["perf"]
    assert perf["model_flops_per_step"] > 0 and perf["peak_tflops"] == 1.0 and perf["mfu"] > 0


def test_second_invocation_reuses_finished_runs(compared):
    _, (document, status) = compared
    assert [r["status"] for r in document["runs"]] == ["cached", "cached"]
    assert status == 0
