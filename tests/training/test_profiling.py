"""Megatron-LM's ``--profile`` options in ``megatron-npu train``: the window of steps, the ranks,
the files the torch profiler leaves, the capture range for Nsight Systems on cuda, and the
options that would profile nothing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_npu.devices.facts import CUDA, facts
from megatron_npu.formats.metrics import MetricsFile
from megatron_npu.formats.profile_summary import ProfileSummary
from megatron_npu.training import arguments, profiling
from megatron_npu.training.options import TrainOptions

from ._runner import TINY, train

TRACE_READ = "aten::_local_scalar_dense"


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Two ranks, 4 steps, steps 2 and 3 profiled on rank 1 alone (the torch profiler's window:
    START..END-1)."""
    tmp = tmp_path_factory.mktemp("profiled")
    folder = tmp / "profile"
    run = train(
        tmp,
        *TINY,
        "--train-iters", "4",
        "--profile", "--use-pytorch-profiler",
        "--profile-step-start", "2", "--profile-step-end", "4",
        "--profile-ranks", "1",
        "--profile-dir", str(folder),
        nproc=2,
    )  # fmt: skip
    return run, folder


def test_the_profiled_rank_writes_a_trace_and_its_summary(profiled):
    run, folder = profiled
    assert sorted(p.name for p in folder.iterdir()) == ["summary-rank1.json", "trace-rank1.json"]
    summary = ProfileSummary.read(folder / "summary-rank1.json")
    assert (summary.rank, summary.steps, summary.device) == (1, [2, 3], "cpu")
    assert summary.trace == "trace-rank1.json"
    assert summary.device_kernel_s_per_step is None and summary.device_kernels_per_step is None
    assert summary.host_ops_per_step > 0 and summary.top and summary.wall_s_per_step > 0
    assert " profile of steps [2, 3]: " in run.stdout


def test_the_summary_counts_what_the_trace_holds(profiled):
    """The device reads of the summary are the trace's ``_local_scalar_dense`` events per step."""
    _, folder = profiled
    trace = json.loads((folder / "trace-rank1.json").read_text())
    reads = sum(1 for e in trace["traceEvents"] if e.get("name") == TRACE_READ)
    summary = ProfileSummary.read(folder / "summary-rank1.json")
    assert reads > 0
    assert summary.device_reads_per_step == reads / 2


def test_without_the_torch_profiler_off_cuda_one_line_and_the_torch_profiler(tmp_path):
    """``--profile`` alone asks for Nsight's capture range; on cpu the torch profiler records that
    window (START+1..END) instead and one line says so. The window holds step 1 on rank 1: its
    host allocator peak cannot be measured (the probe is a profiler too), so the run reports
    none rather than rank 0's alone as the largest over the ranks."""
    folder = tmp_path / "p"
    run = train(
        tmp_path,
        *TINY,
        "--train-iters", "2",
        "--profile", "--profile-step-start", "0", "--profile-step-end", "1",
        "--profile-ranks", "1", "--profile-dir", str(folder),
        nproc=2,
    )  # fmt: skip
    said = [line for line in run.stdout.splitlines() if "--use-pytorch-profiler" in line]
    assert said == [
        "megatron-npu: --profile without --use-pytorch-profiler asks for Nsight Systems' capture "
        f"range, which is CUDA's; on cpu the torch profiler records steps 1..1 into {folder}"
    ]
    assert ProfileSummary.read(folder / "summary-rank1.json").steps == [1]
    metrics = MetricsFile.read(run.metrics_path)
    assert metrics.summary.peak_memory_bytes is None
    assert "peak allocated not measured" in run.stdout


class _CudaRuntime:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cudaProfilerStart(self) -> None:  # noqa: N802 - CUDA's name
        self.calls.append("start")

    def cudaProfilerStop(self) -> None:  # noqa: N802
        self.calls.append("stop")


class _Nvtx:
    def __init__(self, calls: list[str], **_: object) -> None:
        self.calls = calls

    def __enter__(self):
        self.calls.append("nvtx on")

    def __exit__(self, *exc):
        self.calls.append("nvtx off")


def test_on_cuda_without_the_torch_profiler_the_window_is_nsights_capture_range(monkeypatch):
    """Megatron-LM's ``--profile`` on a GPU: ``cudaProfilerStart`` before step START+1 with NVTX
    ranges on, ``cudaProfilerStop`` after step END; no torch profiler, no files."""
    runtime = _CudaRuntime()
    monkeypatch.setattr(profiling.torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(
        profiling.torch.autograd.profiler, "emit_nvtx", lambda **kw: _Nvtx(runtime.calls, **kw)
    )
    args = SimpleNamespace(
        profile=True,
        use_pytorch_profiler=False,
        profile_step_start=2,
        profile_step_end=4,
        profile_ranks=[0],
        profile_dir="/nonexistent",
    )
    cuda = SimpleNamespace(name=CUDA, facts=facts(CUDA))
    profiler = profiling.StepProfiler(args, cuda, 0)
    seen = []
    for step in range(1, 7):
        profiler.starting(step)
        seen.append((step, list(runtime.calls)))
        profiler.finished(step, 0.1)
    profiler.close()
    assert seen[1] == (2, []) and seen[2] == (3, ["start", "nvtx on"])
    assert runtime.calls == ["start", "nvtx on", "nvtx off", "stop"]
    assert seen[4] == (5, ["start", "nvtx on", "nvtx off", "stop"])


def _megatron_lm_records(start: int, end: int, iterations: int) -> list[int]:
    """The iterations Megatron-LM's loop records with ``--use-pytorch-profiler``: torch's own
    schedule as Megatron-LM builds it, ``prof.step()`` at the top of each iteration."""
    schedule = torch.profiler.schedule(
        wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
    )
    recording = {
        torch.profiler.ProfilerAction.RECORD,
        torch.profiler.ProfilerAction.RECORD_AND_SAVE,
    }
    return [i for i in range(1, iterations + 1) if schedule(i) in recording]


@pytest.mark.parametrize("start, end", [(10, 12), (0, 3), (1, 2), (4, 9)])
def test_the_torch_profilers_window_is_megatron_lms(start, end):
    args = SimpleNamespace(profile_step_start=start, profile_step_end=end)
    args.use_pytorch_profiler = True
    assert list(arguments.profile_window(args)) == _megatron_lm_records(start, end, 20)
    args.use_pytorch_profiler = False  # Nsight's range: started at START done, stopped at END
    assert list(arguments.profile_window(args)) == list(range(start + 1, end + 1))


def test_device_time_counts_kernels_not_the_annotations_over_them():
    """On a GPU a ``record_function`` range also shows on the device timeline, spanning the
    kernels under it: the summary's kernel time leaves it out."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def entry(key, device, us, count=1, annotation=False):
        return SimpleNamespace(
            key=key,
            device_type=device,
            count=count,
            self_cpu_time_total=0.0 if device == cuda else us,
            self_device_time_total=us if device == cuda else 0.0,
            is_user_annotation=annotation,
        )

    averages = [
        entry("aten::mm", cpu, 50.0, count=2),
        entry("sm90_gemm", cuda, 300.0, count=2),
        entry("elementwise", cuda, 100.0, count=4),
        entry("Optimizer.step#AdamW.step", cuda, 400.0, annotation=True),
    ]
    prof = SimpleNamespace(key_averages=lambda: averages)
    summary = profiling.summarize(prof, what="t", device=CUDA, steps=[1, 2], wall_s=[0.01])
    assert summary.device_kernel_s_per_step == pytest.approx(400e-6 / 2)
    assert summary.device_kernels_per_step == 3
    assert [op.name for op in summary.top] == ["sm90_gemm", "elementwise"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile-step-start", "3", "--profile-step-end", "3"], "must be greater than"),
        (["--profile-step-start", "4", "--profile-step-end", "6"], "records steps 5..6, none"),
        (
            ["--profile-step-start", "0", "--profile-step-end", "1", "--use-pytorch-profiler"],
            "records no step",
        ),
    ],
)
def test_a_window_that_profiles_nothing_is_named(extra, message):
    with pytest.raises(arguments.ArgumentError, match=message):
        TrainOptions.parse([*TINY, "--train-iters", "4", "--profile", *extra])


def test_a_profile_rank_outside_the_world_is_named():
    options = TrainOptions.parse(
        [*TINY, "--train-iters", "4", "--profile", "--profile-step-end", "2"]
        + ["--profile-step-start", "0", "--profile-ranks", "0", "2"]
    )
    with pytest.raises(arguments.ArgumentError, match=r"--profile-ranks \[2\] are not ranks"):
        arguments.finalize(options.args, 2)


def _cpu_profiler(tmp_path, start: int, end: int) -> profiling.StepProfiler:
    args = SimpleNamespace(
        profile=True,
        use_pytorch_profiler=True,
        profile_step_start=start,
        profile_step_end=end,
        profile_ranks=[0],
        profile_dir=str(tmp_path / "p"),
    )
    return profiling.StepProfiler(args, SimpleNamespace(name="cpu", facts=facts("cpu")), 0)


def _drive(profiler: profiling.StepProfiler, steps) -> None:
    for step in steps:
        profiler.starting(step)
        torch.ones(8).sum().item()
        profiler.finished(step, 0.01)
    profiler.close()


def test_a_run_resumed_inside_the_window_profiles_the_rest(tmp_path):
    """Megatron-LM's default window with the torch profiler is steps 10..11; a run resumed at
    step 11 profiles step 11."""
    _drive(_cpu_profiler(tmp_path, 10, 12), range(11, 15))
    summary = ProfileSummary.read(tmp_path / "p" / "summary-rank0.json")
    assert summary.steps == [11] and summary.device_reads_per_step == 1


def test_a_run_that_trains_none_of_the_window_says_so(tmp_path, capsys):
    _drive(_cpu_profiler(tmp_path, 10, 12), range(12, 15))
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron-npu: --profile: this run trained none of steps 10..11; nothing was profiled"
    ]
    assert not (tmp_path / "p").exists()
