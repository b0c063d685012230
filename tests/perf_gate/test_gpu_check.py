"""The GPU check (``perf/gpu_check.py``) decides, without a GPU, what it will run on one: its
matrix loads through compare's own reader, every row is an optional ``cuda`` row (skipped where
no GPU is), Table 2's eight 16-bit flash/sparse configurations and the three unfused precisions
are all there, and ``megatron-npu train``'s row beside Megatron-LM's script has the script's own
options. The fused attention it times on ``cuda`` is the registry entry that applies there."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_npu.compare import matrix
from megatron_npu.devices.facts import CUDA
from megatron_npu.patcher import megatron_core_version, plan_status
from megatron_npu.registry import get_patch
from perf import gpu_check

H100_TINY_ARGS = (
    Path(__file__).resolve().parents[3] / "shared" / "gpu-logs" / "h100-tiny" / "ARGS.txt"
)


@pytest.fixture(scope="module")
def gpu_matrix(tmp_path_factory) -> matrix.Matrix:
    script = tmp_path_factory.mktemp("mlm") / "pretrain_gpt.py"
    path = script.parent / "matrix.toml"
    path.write_text(gpu_check.MATRIX.read_text() + "\n" + gpu_check.megatron_lm_rows(script))
    return matrix.load(path)


def test_every_row_is_an_optional_cuda_row(gpu_matrix):
    assert gpu_matrix.runs and all(
        run.devices == (CUDA,) and run.optional for run in gpu_matrix.runs
    )


def test_every_configuration_of_the_table_is_there(gpu_matrix):
    seen = set()
    for run in gpu_matrix.runs:
        o = run.options
        precision = "bf16" if o.get("bf16") else "fp16" if o.get("fp16") else "fp32"
        if not o.get("use-flash-attn"):
            seen.add((precision, "unfused"))
            continue
        variant = "sparse" if "pre-tokens" in o else "flash"
        seen.add((precision, variant, o.get("shape-order", "SBH")))
    sixteen_bit = {
        (p, v, s) for p in ("bf16", "fp16") for v in ("flash", "sparse") for s in ("SBH", "BSH")
    }
    assert sixteen_bit | {(p, "unfused") for p in ("fp32", "bf16", "fp16")} <= seen


def test_sparse_rows_use_the_seeds_window():
    runs = matrix.load(gpu_check.MATRIX).runs
    sparse = [r for r in runs if "pre-tokens" in r.options]
    assert len(sparse) == 4
    assert all((r.options["pre-tokens"], r.options["next-tokens"]) == (2048, 0) for r in sparse)
    assert all(r.options.get("seq-length", 8192) == 8192 for r in sparse)


def test_fp16_rows_start_from_a_loss_scale_that_trains_from_step_one():
    """Megatron's default initial scale, 2^32, skips the first 17 of 20 steps (seen on an
    H100: only three fp16 steps were compared)."""
    fp16 = [r for r in matrix.load(gpu_check.MATRIX).runs if r.options.get("fp16")]
    assert fp16 and all(r.options.get("initial-loss-scale", 2**32) <= 2**16 for r in fp16)


def test_train_beside_the_script_has_the_scripts_options(gpu_matrix):
    runs = {r.name: r for r in gpu_matrix.runs}
    script, train = runs["mlm-fp32"], runs["train-as-mlm-fp32"]
    assert train.reference == "mlm-fp32" and script.kind == "script"
    given = gpu_check._options_of(list(script.script_args))
    apex_only = {"no-gradient-accumulation-fusion", "no-persist-layer-norm"}
    not_train = {"eval-iters", "eval-interval", "tokenizer-type"}  # train's own defaults
    expected = {k: v for k, v in given.items() if k not in apex_only | not_train}
    assert {k: str(v) if v is not True else v for k, v in train.options.items()} == expected


def test_the_script_rows_are_the_h100_runs_arguments():
    """The script rows pass the arguments of the native H100 runs in ``shared/gpu-logs/h100-tiny``
    (which core_v0.16.1's pretrain_gpt.py ran), less the 60 steps (30 here) and less
    ``--no-masked-softmax-fusion``: Megatron-LM's default fusion stays on, for
    ``softmax.cuda-kernel-missing`` to serve."""
    assert H100_TINY_ARGS.is_file(), f"{H100_TINY_ARGS}: the shared GPU logs are missing"
    native = H100_TINY_ARGS.read_text().split()
    native[native.index("--train-iters") + 1] = "30"
    native.remove("--no-masked-softmax-fusion")
    assert gpu_check.MLM_ARGS == native


def test_a_selection_of_runs_keeps_what_they_are_judged_against(tmp_path):
    """``--runs`` keeps the named rows, their references (explicit or the baseline) and the
    baseline, and the result is a matrix compare's reader takes."""
    script = tmp_path / "pretrain_gpt.py"
    text = gpu_check.MATRIX.read_text() + "\n" + gpu_check.megatron_lm_rows(script)
    path = tmp_path / "matrix.toml"
    path.write_text(gpu_check.select_runs(text, ["cuda-fp16-flash-sbh", "train-as-mlm-fp32"]))
    kept = {r.name: r for r in matrix.load(path).runs}
    assert set(kept) == {
        "cuda-fp32", "cuda-fp16", "cuda-fp16-flash-sbh", "mlm-fp32", "train-as-mlm-fp32",
    }  # fmt: skip
    assert kept["cuda-fp16-flash-sbh"].options["initial-loss-scale"] == 65536
    assert kept["train-as-mlm-fp32"].reference == "mlm-fp32"
    with pytest.raises(ValueError, match="'no-such-run'"):
        gpu_check.select_runs(text, ["cuda-fp16", "no-such-run"])


def test_flash_attention_applies_on_cuda():
    """--use-flash-attn on cuda: the fused-attention entry is planned there (without it
    ``megatron-npu train`` refuses the option on cuda)."""
    entry = get_patch("attention.dot-product")
    assert plan_status(entry, CUDA, megatron_core_version()) == ("", "")


@pytest.fixture
def small_fairness_row(tmp_path) -> Path:
    """A matrix whose fairness row is a small model on this host."""
    path = tmp_path / "matrix.toml"
    path.write_text(
        "[compare]\nwarmup_steps = 3\n\n"
        f'[[run]]\nname = "{gpu_check.FAIRNESS_RUN}"\ndevice = "cpu"\noptions = {{ '
        "num-layers = 2, hidden-size = 64, num-attention-heads = 4, seq-length = 32, "
        "micro-batch-size = 2, global-batch-size = 4, train-iters = 12, lr = 1e-4, "
        "mock-data = true, vocab-size = 200, use-flash-attn = true }\n"
    )
    return path


def test_the_breakdown_profiles_the_row_and_its_twin_alike(tmp_path, small_fairness_row):
    """The breakdown part on this host: train's profiled steps and the twin's, the same steps
    under the same profiler, each summary typed."""
    from megatron_npu.formats.profile_summary import ProfileSummary

    out = tmp_path / "out"
    out.mkdir()
    ok = gpu_check.breakdown(out, small_fairness_row, device="cpu")
    assert ok, (out / "profile-run.log").read_text()
    train = ProfileSummary.read(out / "profile" / "train" / "summary-rank0.json")
    plain = ProfileSummary.read(out / "profile" / "plain-summary.json")
    assert train.steps == plain.steps == list(gpu_check.PROFILED)
    assert (train.what, plain.what) == ("megatron-npu train", "plain PyTorch twin")
    assert train.device == plain.device == "cpu"


def test_fairness_without_the_compare_part_runs_the_row_itself(tmp_path, small_fairness_row):
    """No compare results: the row runs alone and is measured by compare's statistic (its
    median after the matrix's 3 warm-up steps), against the twin of the same row."""
    from megatron_npu.compare import rules
    from megatron_npu.formats.fairness_record import FairnessRecord
    from megatron_npu.formats.metrics import MetricsFile

    out = tmp_path / "out"
    out.mkdir()
    fair = gpu_check.fairness(out, small_fairness_row, device="cpu")
    record = FairnessRecord.read(out / "fairness.json")
    metrics = MetricsFile.read(out / "fairness-run" / "metrics.json")
    stats = rules.step_time_stats([s.step_time_s for s in metrics.steps], 3)
    assert record.megatron_npu_source == "a run of the row alone (fairness-run/)"
    assert record.megatron_npu_s_per_step == stats.median
    assert record.megatron_npu_ci95 == tuple(stats.ci95)
    assert record.ratio == stats.median / record.plain_torch_eager_s_per_step
    assert fair == (record.ratio <= gpu_check.FAIRNESS_TARGET == record.target)
    assert (record.micro_batches, record.shape.micro_batch_size, record.device) == (2, 2, "cpu")


def test_a_failed_row_run_names_its_log(tmp_path, small_fairness_row):
    """The row's run failing (here: a learning rate of 0, which train stops as a run that trains
    nothing) is one error naming the log, not a missing metrics file."""
    text = small_fairness_row.read_text()
    small_fairness_row.write_text(text.replace("lr = 1e-4", "lr = 0.0"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match=r"ended with exit 3: see .*fairness-run\.log"):
        gpu_check.fairness(out, small_fairness_row, device="cpu")
