"""A matrix run of a user's own Megatron-LM script: Megatron-LM's unmodified pretrain_gpt.py
(the release matching the installed megatron-core, from ../shared/megatron-lm) launched by
compare through torchrun and megatron_npu.run_script on npu-emulated, its log read back and judged
against the log the same configuration wrote on cpu (fixtures/megatron-lm/tp2-cpu.log)."""

from __future__ import annotations

import contextlib
import io
import socket
import sys
from pathlib import Path

import pytest

from megatron_npu.compare import command
from megatron_npu.compare import matrix as m
from megatron_npu.locate.command import LocateError, side_from_compare
from megatron_npu.training import weight_nudge
from tests.megatron_lm._client import megatron_lm_folder

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).with_name("fixtures") / "megatron-lm"
#: fixtures/megatron-lm/README.md: the arguments its logs were written with
ARGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "12",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1024",
    "--transformer-impl",
    "local",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--tensor-model-parallel-size",
    "2",
]


@contextlib.contextmanager
def _port_held(port: int):
    """Another program listening on ``port`` meanwhile (when one already does, it stays held)."""
    with socket.socket() as listener:
        with contextlib.suppress(OSError):
            listener.bind(("", port))
            listener.listen()
        yield


def test_a_megatron_lm_script_runs_through_the_adaptor_and_is_judged(tmp_path, monkeypatch):
    # the steering repo's shared/ is beside every checkout CI runs: a missing one is a failure
    # (megatron_lm_folder names the folder it looked in)
    script = megatron_lm_folder() / "pretrain_gpt.py"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    args = ", ".join(f'"{a}"' for a in ARGS)
    (tmp_path / "m.toml").write_text(
        f'[compare]\nbaseline = "mlm-cpu"\n'
        f'[[run]]\nname = "mlm-cpu"\nimport = "{FIXTURES / "tp2-cpu.log"}"\ndevice = "cpu"\n'
        f'[[run]]\nname = "mlm-script"\nscript = "{script}"\nargs = [{args}]\n'
        'nproc_per_node = 2\ndevice = "npu-emulated"\ntimeout_s = 540\n'
    )
    echo = io.StringIO()
    # torchrun's default port, held by another run on the same host, does not stop this one
    with contextlib.redirect_stdout(echo), _port_held(29500):
        document, status = command.run_compare(m.load(tmp_path / "m.toml"), tmp_path / "out")
    runs = {r["name"]: r for r in document["runs"]}
    assert runs["mlm-script"]["status"] == "ok", runs["mlm-script"]["error"]
    assert runs["mlm-script"]["command"][-len(ARGS) - 1 :] == [str(script), *ARGS]
    assert len(runs["mlm-script"]["steps"]) == 12
    verdicts = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    assert verdicts[("mlm-script", "fingerprint")]["status"] == "pass"
    assert verdicts[("mlm-script", "approximate")]["status"] == "pass", verdicts[
        ("mlm-script", "approximate")
    ]
    assert verdicts[("mlm-script", "performance")]["status"] == "not-applicable"
    assert (tmp_path / "out" / "runs" / "mlm-script" / "metrics.json").is_file()
    assert status == 0, echo.getvalue()[-3000:]


def test_rounding_reruns_of_a_script_run_give_its_candidate_a_band(tmp_path, monkeypatch):
    """The noise rule for a user's own script: compare reruns the cpu run of pretrain_gpt.py
    with its initial weights one bf16 ulp up (run_script's hook on Megatron-LM's get_model) and
    with another host thread count, and judges the npu-emulated run of the same script against
    the band the two reruns span."""
    script = megatron_lm_folder() / "pretrain_gpt.py"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setitem(sys.modules, "megatron_npu.reports", None)
    one_rank = ARGS[: ARGS.index("--tensor-model-parallel-size")] + ["--bf16"]
    one_rank[one_rank.index("--train-iters") + 1] = "6"
    args = ", ".join(f'"{a}"' for a in one_rank)
    (tmp_path / "m.toml").write_text(
        f'[compare]\nbaseline = "ref"\nlambada = false\n'
        f'[[run]]\nname = "ref"\nscript = "{script}"\nargs = [{args}]\ndevice = "cpu"\n'
        '[[run]]\nname = "ref-ulp-up"\nrerun_of = "ref"\nperturb = "init-ulp"\n'
        '[[run]]\nname = "ref-threads"\nrerun_of = "ref"\nperturb = "threads"\n'
        f'[[run]]\nname = "npu"\nscript = "{script}"\nargs = [{args}]\n'
        'device = "npu-emulated"\n'
    )
    echo = io.StringIO()
    with contextlib.redirect_stdout(echo):
        document, status = command.run_compare(m.load(tmp_path / "m.toml"), tmp_path / "out")
    runs = {r["name"]: r for r in document["runs"]}
    for name, run in runs.items():
        assert run["status"] == "ok", (name, run["error"])

    def losses(name):
        return [step["loss"] for step in runs[name]["steps"]]

    # the nudge reached the script's model: the rerun starts elsewhere, by rounding only
    assert len(losses("ref")) == 6 and losses("ref-ulp-up") != losses("ref")
    assert all(
        abs(a - b) <= 1e-2 * a for a, b in zip(losses("ref"), losses("ref-ulp-up"), strict=True)
    )
    assert "OMP_NUM_THREADS=2" in echo.getvalue()
    # each rerun's recorded command carries the environment it changed, and so reproduces it
    assert runs["ref-ulp-up"]["command"][:2] == ["env", f"{weight_nudge.ENV}=1"]
    assert runs["ref-threads"]["command"][:2] == ["env", "OMP_NUM_THREADS=2"]
    assert runs["ref"]["command"][0] != "env"
    assert runs["ref-ulp-up"]["command"][-len(one_rank) - 1 :] == [str(script), *one_rank]
    # locate replays both sides under one environment: a perturbed rerun is refused by name
    ref_side, _ = side_from_compare(tmp_path / "out", "ref")
    assert ref_side.script == str(script) and ref_side.device == "cpu"
    with pytest.raises(LocateError, match=rf"'ref-ulp-up' ran with {weight_nudge.ENV}=1 \(a pert"):
        side_from_compare(tmp_path / "out", "ref-ulp-up")
    verdicts = {(v["candidate"], v["rule"]): v for v in document["verdicts"]}
    assert verdicts[("npu", "noise")]["status"] == "pass", verdicts[("npu", "noise")]
    assert ("ref-ulp-up", "noise") not in verdicts  # a rerun measures; it is not judged
    assert status == 0, echo.getvalue()[-3000:]


#: the end of a failed two-rank pretrain_gpt.py run under torchrun (Megatron's exception on each
#: rank, then the elastic agent's own traceback and footer)
TORCHRUN_FAILURE = """\
[rank1]:   File "/m/megatron/core/transformer/torch_norm.py", line 30, in __new__
[rank1]: AssertionError: persist_layer_norm not supported by torch LayerNorm
[rank0]:   File "/m/megatron/core/transformer/torch_norm.py", line 30, in __new__
[rank0]: AssertionError: persist_layer_norm not supported by torch LayerNorm
E1127 05:01:02.000000 123 torch/distributed/elastic/multiprocessing/api.py:900] \
failed (exitcode: 1) local_rank: 0 (pid: 7) of binary: /usr/bin/python
Traceback (most recent call last):
  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 900, in main
    run(args)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
megatron_npu.run_script FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_05:01:02
  host      : vm
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 7)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_runs_reason_is_the_scripts_own_last_error_line(tmp_path):
    from megatron_npu.compare import runner

    log = tmp_path / "script.log"
    log.write_text(TORCHRUN_FAILURE)
    reason = runner._failure(1, TORCHRUN_FAILURE.splitlines()[-15:], 600, log)
    assert (
        reason == "exit code 1: AssertionError: persist_layer_norm not supported by torch LayerNorm"
    )
    refused = "[rank0]: something\nmegatron-npu: --context-parallel-size 2 needs ... (one line)\n"
    log.write_text(refused + TORCHRUN_FAILURE.split("E1127", 1)[1])
    assert runner._failure(2, [], 600, log) == (
        "exit code 2: megatron-npu: --context-parallel-size 2 needs ... (one line)"
    )
    # without a line of its own, the tail as before
    log.write_text("Killed\n")
    assert runner._failure(137, ["Killed"], 600, log) == "exit code 137: Killed"
