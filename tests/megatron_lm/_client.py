"""Run Megatron-LM's own ``pretrain_gpt.py`` (``../shared/megatron-lm/<tag>``, unmodified) through
the one-line wrapper ``python -m megatron_npu.run_script`` under ``torchrun``, and read what it
wrote: its ``iteration N/ M | ...`` log lines and its TensorBoard scalars."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_npu.compare import mlm_log
from megatron_npu.patcher import megatron_core_version

REPO = Path(__file__).resolve().parents[2]
#: Megatron-LM's training layer per release tag (the steering repo's shared/ folder)
SHARED = Path(os.environ.get("MEGATRON_LM_ROOT", REPO.parent / "shared" / "megatron-lm"))

#: the shared README's tiny GPT, with Megatron's own defaults otherwise (gradient-accumulation
#: fusion, bias-GELU / masked-softmax / bias-dropout fusions, dropout 0.1, jit warm-up)
TINY = (
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
    "--lr",
    "1e-3",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1024",
    "--transformer-impl",
    "local",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--log-interval",
    "1",
)

#: DeepSeek-style multi-latent attention, small: query and key/value compressed to rank 32,
#: q/k heads of 16 + 8 rotated features, v heads of 8 (narrower: the fused op pads them), YaRN
MLA = (
    "--multi-latent-attention",
    "--q-lora-rank",
    "32",
    "--kv-lora-rank",
    "32",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "8",
    "--position-embedding-type",
    "rope",
)

#: the precision-aware optimizer's memory-saving recipe on a bf16 model (TE's FusedAdam on a
#: GPU): the distributed optimizer, bf16 grads and moments, the master as bf16 + remainders
PRECISION_AWARE = (
    "--bf16",
    "--use-distributed-optimizer",
    "--use-precision-aware-optimizer",
    "--main-grads-dtype",
    "bf16",
    "--exp-avg-dtype",
    "bf16",
    "--exp-avg-sq-dtype",
    "bf16",
)


def client_devices() -> tuple[str, ...]:
    """Devices the run list covers: npu-emulated in the default suite, both in tox
    (``MEGATRON_NPU_CLIENT_DEVICES=cpu,npu-emulated``)."""
    raw = os.environ.get("MEGATRON_NPU_CLIENT_DEVICES", "npu-emulated")
    return tuple(d.strip() for d in raw.split(",") if d.strip())


def client_specs() -> tuple[str, ...]:
    """Layer specs (``--transformer-impl``) the run list covers: ``local`` in the default suite
    (the Transformer Engine spec has its own tests there), both in tox
    (``MEGATRON_NPU_CLIENT_SPECS=local,transformer_engine``)."""
    raw = os.environ.get("MEGATRON_NPU_CLIENT_SPECS", "local")
    return tuple(s.strip() for s in raw.split(",") if s.strip())


def megatron_lm_folder() -> Path:
    """The Megatron-LM tag of the installed megatron-core's release line: ``core_v<version>``,
    else the newest ``core_v<major.minor>.*`` (0.19.2's wheel pairs with the core_v0.19.0 tag)."""
    from packaging.version import Version

    installed = Version(megatron_core_version())
    exact = SHARED / f"core_v{installed}"
    same_line = sorted(
        (
            f
            for f in SHARED.glob(f"core_v{installed.major}.{installed.minor}.*")
            if (f / "pretrain_gpt.py").is_file()
        ),
        key=lambda f: Version(f.name.removeprefix("core_v")),
    )
    folder = exact if (exact / "pretrain_gpt.py").is_file() else (same_line or [exact])[-1]
    if not (folder / "pretrain_gpt.py").is_file():
        raise AssertionError(
            f"no Megatron-LM training layer for megatron-core {installed} at {folder} (the "
            "steering repo's shared/megatron-lm; set MEGATRON_LM_ROOT elsewhere)"
        )
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    returncode: int
    log: str
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, bool] = field(default_factory=dict)
    tensorboard: Path | None = None

    def scalars(self, tag: str) -> dict[int, float]:
        """TensorBoard scalar ``tag`` per iteration, read by compare's event-folder importer."""
        from megatron_npu.compare import tensorboard_events

        assert self.tensorboard is not None, "the run wrote no TensorBoard folder"
        return tensorboard_events.read(self.tensorboard)["scalars"][tag]

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-lines:])


def _tensorboard_dir(tmp: Path, name: str) -> Path:
    return tmp / f"{name}-tb"


def pretrain_gpt(
    tmp: Path,
    *args: str,
    nproc: int = 1,
    device: str = "cpu",
    name: str = "run",
    tensorboard: bool = True,
    env: dict[str, str] | None = None,
    timeout: int = 600,
) -> Run:
    """Launch ``pretrain_gpt.py ARGS`` on ``nproc`` ranks of ``device``; return its log."""
    folder = megatron_lm_folder()
    tb = _tensorboard_dir(tmp, name)
    extra = ("--tensorboard-dir", str(tb), "--tensorboard-log-interval", "1") if tensorboard else ()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        # the agent's store binds a port of the system's choosing and the ranks are told it: a
        # port picked here, released and bound again by torchrun can be taken in between
        "--standalone",
        "-m",
        "megatron_npu.run_script",
        str(folder / "pretrain_gpt.py"),
        *args,
        *extra,
    ]
    run_env = {
        **os.environ,
        "MEGATRON_NPU_DEVICE": device,
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]),
        # torchrun's log folders and the ranks' temporary files stay in the test's own folder
        "TMPDIR": str(tmp),
        **(env or {}),
    }
    # its own process group: at the timeout the ranks go with torchrun, not on as orphans
    with subprocess.Popen(
        command,
        cwd=tmp,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # gone at the very moment
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    (tmp / f"{name}.log").write_text(stdout)
    (tmp / f"{name}.rc").write_text(str(proc.returncode))
    return read_run(tmp, name, tensorboard)


def read_run(tmp: Path, name: str, tensorboard: bool = True) -> Run:
    """The run :func:`pretrain_gpt` left in ``tmp`` as ``name`` (its log, exit status and, when
    it wrote one, TensorBoard folder)."""
    log = (tmp / f"{name}.log").read_text()
    tb = _tensorboard_dir(tmp, name) if tensorboard else None
    run = Run(int((tmp / f"{name}.rc").read_text()), log, tensorboard=tb)
    try:  # compare's Megatron-LM log importer: one reading of that log for product and tests
        parsed = mlm_log.parse(tmp / f"{name}.log")
    except mlm_log.LogFormatError:  # a run that logged no step: the tests read the text
        return run
    for record in parsed["iterations"]:
        iteration = record["iteration"]
        if record.get("lm_loss") is not None:
            run.losses[iteration] = record["lm_loss"]
        if record.get("grad_norm") is not None:
            run.grad_norms[iteration] = record["grad_norm"]
        run.skipped[iteration] = bool(record.get("skipped"))
    return run


def check_trained(run: Run, iterations: int, *, min_applied: int = 10) -> None:
    """Ended 0, logged every iteration, applied enough steps, and the loss fell."""
    assert run.returncode == 0, run.tail()
    assert sorted(run.skipped) == list(range(1, iterations + 1)), (sorted(run.skipped), run.tail())
    applied = [i for i in sorted(run.losses) if not run.skipped[i]]
    assert len(applied) >= min_applied, f"only {len(applied)} applied steps\n{run.tail()}"
    first = sum(run.losses[i] for i in applied[:3]) / 3
    last = sum(run.losses[i] for i in applied[-3:]) / 3
    assert last < first - 0.05, (first, last, run.losses)
