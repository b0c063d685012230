"""The GPU check: the competitor side of Table 2 on one GPU without apex or Transformer Engine.

    python perf/gpu_check.py --out DIR [--megatron-lm CHECKOUT]

On a machine whose torch sees a CUDA device it writes, into ``DIR``:

* ``machine.txt``: the GPU (``nvidia-smi``), torch, CUDA and megatron-core versions;
* ``attention.json``: the fused-attention op on ``cuda`` (what ``--use-flash-attn`` runs there:
  ``scaled_dot_product_attention``) against Megatron's unfused arithmetic in the same precision,
  forward and backward, for the causal and the 2048/0 window at sequence 8192 in SBH and BSH, fp32,
  bf16 and fp16; each case's error against an fp32 reference of the same inputs beside the
  unfused path's own, and which SDPA kernels accept the calls (flash for the causal case in 16
  bits, memory-efficient for the masked ones);
* ``compare/``: ``megatron-npu compare`` of ``perf/gpu_matrix.toml`` (every precision and
  attention variant of ``megatron-npu train --device cuda``), plus, with ``--megatron-lm``,
  Megatron-LM's own ``pretrain_gpt.py`` on ``cuda`` through ``megatron_npu.run_script`` in fp32 and
  bf16 (pip's megatron-core: no Makefile for the dataset helpers, no fused-softmax extension) and
  ``megatron-npu train`` with the same options held against the script's fp32 curve;
* ``fairness.json``: the GPT-345M ``--use-flash-attn`` bf16 row's s/step against the same model
  written plainly (``perf/plain_gpt.py``, SDPA's flash kernel, eager) with the row's own batch,
  micro-batches and dropout; the target is a ratio of at most 1.25
  (:class:`megatron_npu.formats.fairness_record.FairnessRecord`);
* ``profile/``: where that row's step time goes beside its twin's (``train --profile
  --use-pytorch-profiler`` and the same profiler around the twin): kernel time against wall
  time, kernels, device reads, the ops that took the time.

``--only PART...`` runs some parts, so the check fits commands of a few minutes each:
``fairness`` takes the row's s/step from the ``compare`` part's results when that part ran it,
else runs the row alone (``fairness-run/``) and measures it by compare's own statistic.
``--runs NAME...`` has the compare part run only those rows and the rows they are judged against.

Every part runs even when an earlier one failed; the exit status is 1 if any did (a run that did
not finish, an attention case beyond its bound, a ratio above the target). Verdicts that fail are
printed: they are findings about the numerics, not failures of the check. On one H100 it takes
about 9 minutes (the matrix's 16 runs about 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_npu.compare.matrix import parse, tomllib
from megatron_npu.devices.facts import CUDA
from megatron_npu.formats.compare_results import CompareResults
from megatron_npu.formats.fairness_record import FairnessRecord

HERE = Path(__file__).resolve().parent
MATRIX = HERE / "gpu_matrix.toml"
FAIRNESS_RUN = "cuda-bf16-flash-345m"
FAIRNESS_TARGET = 1.25

#: Megatron-LM's pretrain_gpt.py rows: the 4-layer GPT of shared/gpu-logs/h100-tiny (30 steps).
#: gradient-accumulation fusion and the persistent layer norm are apex's: off, as a GPU without
#: apex must run them; masked-softmax fusion stays Megatron-LM's default
#: (softmax.cuda-kernel-missing serves it).
MLM_ARGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "256",
    "--max-position-embeddings",
    "256",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "5",
    "--train-iters",
    "30",
    "--weight-decay",
    "1e-2",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--transformer-impl",
    "local",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1023",
    "--mock-data",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
]


def _options_of(args: list[str]) -> dict[str, object]:
    """The script's arguments as a train run's options (``--flag value`` / bare ``--flag``)."""
    options: dict[str, object] = {}
    i = 0
    while i < len(args):
        name = args[i][2:]
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            options[name] = args[i + 1]
            i += 2
        else:
            options[name] = True
            i += 1
    return options


def _toml_value(value: object) -> str:
    if value is True:
        return "true"
    return json.dumps(str(value))


def megatron_lm_rows(script: Path) -> str:
    """The matrix rows of Megatron-LM's script on cuda and of train with the same options."""
    train_options = {
        k: v
        for k, v in _options_of(MLM_ARGS).items()
        if k
        not in (
            "no-gradient-accumulation-fusion",
            "no-persist-layer-norm",
            "eval-iters",
            "eval-interval",
            "tokenizer-type",
        )
    }
    inline = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in train_options.items())
    rows = []
    for name, extra, reference in (("mlm-fp32", [], "false"), ("mlm-bf16", ["--bf16"], "false")):
        rows.append(
            f'[[run]]\nname = "{name}"\nscript = {json.dumps(str(script))}\n'
            f'args = {json.dumps(MLM_ARGS + extra)}\ndevice = "{CUDA}"\noptional = true\n'
            f"reference = {reference}\n"
        )
    rows.append(
        f'[[run]]\nname = "train-as-mlm-fp32"\ndevice = "{CUDA}"\noptional = true\n'
        f'reference = "mlm-fp32"\noptions = {{ {inline} }}\n'
    )
    return "\n".join(rows)


def machine(out: Path) -> None:
    lines = []
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines.append(smi.stdout.strip())
    except OSError as exc:
        lines.append(f"nvidia-smi: {exc}")
    import megatron.core

    lines.append(
        f"torch {torch.__version__} cuda {torch.version.cuda} "
        f"mcore {megatron.core.__version__} python {sys.version.split()[0]} "
        f"cpus {os.cpu_count()}"
    )
    (out / "machine.txt").write_text("\n".join(lines) + "\n")


def _unfused(q, k, v, visible, scale):
    """Megatron's unfused core attention in q's dtype: scores in that dtype, the softmax in fp32
    rounded back, then the product with v ([b, n, s, d] inputs)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.float().masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def _to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[b, n, s, d] -> the op's SBH ([s, b, n*d]) or BSH ([b, s, n*d])."""
    t = t.permute(2, 0, 1, 3) if layout == "SBH" else t.permute(0, 2, 1, 3)
    return t.reshape(t.shape[0], t.shape[1], -1)


def attention(out: Path, device: str = CUDA, seq: int = 8192, window: int = 2048) -> bool:
    """The fused op on ``device`` against the unfused path (module docstring)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_npu.ops.attention import MAX_TOKENS, native_fused_attention, visible_keys

    torch.manual_seed(0)
    b, heads, dim = 1, 8, 64
    scale = dim**-0.5
    cases, ok = [], True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        base = [torch.randn(b, heads, seq, dim, device=device) for _ in range(3)]
        grad = torch.randn(b, heads, seq, dim, device=device)
        for pre, nxt in ((MAX_TOKENS, 0), (window, 0)):
            lo = -(seq - 1) if pre == MAX_TOKENS else -pre
            visible = visible_keys(0, seq, 0, seq, 0, lo, 0, device)
            q16, k16, v16 = (t.to(dtype).detach() for t in base)
            ref_in = [t.float().clone().requires_grad_() for t in (q16, k16, v16)]
            ref = _unfused(*ref_in, visible, scale)
            ref.backward(grad)
            unf_in = [t.clone().requires_grad_() for t in (q16, k16, v16)]
            unfused = _unfused(*unf_in, visible, scale)
            unfused.backward(grad.to(dtype))
            for layout in ("SBH", "BSH"):
                fin = [_to_layout(t, layout).clone().requires_grad_() for t in (q16, k16, v16)]
                fused = native_fused_attention(
                    *fin,
                    head_num=heads,
                    input_layout=layout,
                    causal=True,
                    pre_tokens=pre,
                    next_tokens=nxt,
                    scale=scale,
                )
                fused.backward(_to_layout(grad.to(dtype), layout))
                record = {
                    "dtype": str(dtype).split(".")[-1],
                    "window": [pre, nxt],
                    "layout": layout,
                }
                pairs = [("out", fused, _to_layout(ref, layout), _to_layout(unfused, layout))]
                for name, f, r, u in zip(("dq", "dk", "dv"), fin, ref_in, unf_in, strict=True):
                    pairs.append(
                        (name, f.grad, _to_layout(r.grad, layout), _to_layout(u.grad, layout))
                    )
                for name, got, want, theirs in pairs:
                    norm = want.float().abs().max().item()
                    fused_err = (got.float() - want.float()).abs().max().item() / norm
                    unfused_err = (theirs.float() - want.float()).abs().max().item() / norm
                    record[name] = {"fused_rel_err": fused_err, "unfused_rel_err": unfused_err}
                    # the fused op may round differently, never worse than twice the unfused
                    # path's own rounding (fp32: both at fp32's level)
                    if fused_err > 2 * unfused_err + 3e-5:
                        ok = record["fail"] = False
                cases.append(record)
            del ref, unfused
    kernels = {}
    q = torch.randn(seq, b, heads * dim, device=device, dtype=torch.bfloat16)
    for label, backend, pre in (
        ("causal bf16 on flash", SDPBackend.FLASH_ATTENTION, MAX_TOKENS),
        (f"window {window}/0 bf16 on memory-efficient", SDPBackend.EFFICIENT_ATTENTION, window),
    ):
        try:
            with sdpa_kernel([backend]):
                native_fused_attention(
                    q, q, q, head_num=heads, causal=True, pre_tokens=pre, next_tokens=0
                )
            kernels[label] = "accepted"
        except RuntimeError as exc:
            kernels[label] = f"refused: {str(exc).splitlines()[0][:200]}"
            ok = False
    (out / "attention.json").write_text(
        json.dumps({"ok": ok, "kernels": kernels, "cases": cases}, indent=1) + "\n"
    )
    return ok


def select_runs(matrix: str, names: Sequence[str]) -> str:
    """``matrix`` (TOML text) with only the runs ``names`` and those they need: the baseline and,
    as compare's reader resolves them, each kept run's reference (its own, else the baseline),
    original of a rerun and named speed pair. A name the matrix lacks raises, naming it."""
    data = tomllib.loads(matrix)
    parsed = parse(data, "gpu_check")
    specs = {spec.name: spec for spec in parsed.runs}
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise ValueError(f"the matrix has no run named {', '.join(map(repr, unknown))}")
    keep: set[str] = set()
    todo = [*names, parsed.settings.baseline]
    while todo:
        name = todo.pop()
        if name in keep or name not in specs:
            continue
        keep.add(name)
        spec = specs[name]
        todo += [n for n in (spec.reference, spec.rerun_of, spec.speed_reference) if n]
    runs = data.get("run", [])
    head, *blocks = re.split(r"(?m)^(?=\[\[run\]\]\s*$)", matrix)
    if len(blocks) != len(runs):
        raise ValueError("every run of the matrix must open with its own [[run]] line")
    kept = (block for block, run in zip(blocks, runs, strict=True) if run["name"] in keep)
    return head + "".join(kept)


def compare(out: Path, megatron_lm: Path | None, runs: Sequence[str] = ()) -> bool:
    """The matrix through ``megatron-npu compare``, only ``runs`` (and what they are judged
    against) when given: ok when every run finished (a failing verdict is a finding, printed,
    not a failure of the check)."""
    matrix = MATRIX.read_text()
    if megatron_lm is not None:
        matrix += "\n" + megatron_lm_rows(megatron_lm.resolve() / "pretrain_gpt.py")
    if runs:
        matrix = select_runs(matrix, runs)
    folder = out / "compare"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "matrix.toml"
    path.write_text(matrix)
    command = [sys.executable, "-m", "megatron_npu.cli", "compare", str(path), "--out", str(folder)]
    with open(out / "compare.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    results = folder / "results.json"
    if not results.is_file():
        return False
    data = CompareResults.read(results)
    unfinished = [r.name for r in data.runs if r.status not in ("ok", "cached")]
    for verdict in data.verdicts:
        if verdict.status not in ("pass", "not-applicable"):
            print(
                f"gpu_check: {verdict.candidate}: {verdict.status} {verdict.rule}: "
                f"{verdict.detail[:160]}"
            )
    if unfinished:
        print(f"gpu_check: runs that did not finish: {', '.join(unfinished)}")
    return not unfinished and bool(data.runs)


def _matrix_of(out: Path) -> Path:
    """The matrix the compare part ran (``compare/matrix.toml``), else the check's own."""
    ran = out / "compare" / "matrix.toml"
    return ran if ran.is_file() else MATRIX


def _fairness_row(matrix_path: Path):
    """The matrix at ``matrix_path`` (compare's reader, which checks every row's options: read
    it once per part) and its :data:`FAIRNESS_RUN` row."""
    from megatron_npu.compare.matrix import load

    matrix = load(matrix_path)
    for spec in matrix.runs:
        if spec.name == FAIRNESS_RUN:
            return matrix, spec
    raise ValueError(f"{matrix_path} has no run named {FAIRNESS_RUN!r}")


def fairness_twin(matrix_path: Path, device: str):
    """The plain trainer of :data:`FAIRNESS_RUN` as the matrix at ``matrix_path`` gives it:
    the same model, micro-batches and dropout (``perf.plain_gpt.twin_of``)."""
    return _twin(_fairness_row(matrix_path)[1], device)


def _twin(spec, device: str):
    from megatron_npu.compare.matrix import option_argv

    sys.path.insert(0, str(HERE.parent))
    from perf.plain_gpt import twin_of

    return twin_of(option_argv(spec.options), device=device)


def _train_row(out: Path, row, device: str, name: str, *extra: str) -> Path:
    """Run :data:`FAIRNESS_RUN` as compare runs a train row (its command, environment and
    timeout), into ``<name>/`` with its output in ``<name>.log``; returns its metrics file. A
    run that fails raises, naming the log."""
    from megatron_npu.compare.runner import stream, train_command

    matrix, spec = row
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)  # never read an earlier run's files
    folder.mkdir(parents=True)
    command = [*train_command(spec, device, folder, folder, checkpoint=False), *extra]
    log = out / f"{name}.log"
    code, _, _ = stream(command, log, matrix.settings.timeout_s)
    if code != 0:
        raise RuntimeError(f"{FAIRNESS_RUN} on {device} ended with exit {code}: see {log}")
    return folder / "metrics.json"


def _row_speed(out: Path, row, device: str) -> tuple[float, list[float], str]:
    """The row's median s/step and its 95 % interval: from the compare part's results when it
    ran the row, else from a run of the row alone, by compare's own statistic and the matrix's
    warm-up steps."""
    from megatron_npu.compare import rules
    from megatron_npu.formats.metrics import MetricsFile

    results = out / "compare" / "results.json"
    run = CompareResults.read(results).run(FAIRNESS_RUN) if results.is_file() else None
    if run is not None and run.perf:
        return run.perf.median_s_per_step, list(run.perf.ci95_s_per_step), "compare"
    metrics = MetricsFile.read(_train_row(out, row, device, "fairness-run"))
    warmup = row[0].settings.warmup_steps
    stats = rules.step_time_stats([s.step_time_s for s in metrics.steps], warmup)
    return stats.median, list(stats.ci95), "a run of the row alone (fairness-run/)"


def _timed_steps(trainer, count: int, device: str) -> list[float]:
    """Wall time of ``count`` steps of ``trainer``, the device synchronised at both ends."""
    sync = torch.cuda.synchronize if device == CUDA else lambda: None
    times = []
    for _ in range(count):
        sync()
        start = time.perf_counter()
        trainer.step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def fairness(out: Path, matrix_path: Path | None = None, device: str = CUDA) -> bool:
    """:data:`FAIRNESS_RUN`'s s/step against its plain twin's (median of 10 steps after 3)."""
    row = _fairness_row(matrix_path or _matrix_of(out))
    ours, ci95, source = _row_speed(out, row, device)
    trainer = _twin(row[1], device)
    plain = statistics.median(_timed_steps(trainer, 13, device)[3:])
    record = FairnessRecord(
        megatron_npu_s_per_step=ours,
        megatron_npu_ci95=ci95,
        megatron_npu_source=source,
        plain_torch_eager_s_per_step=plain,
        ratio=ours / plain,
        target=FAIRNESS_TARGET,
        device=device,
        shape=dataclasses.asdict(trainer.shape),
        micro_batches=trainer.micro_batches,
        dtype=str(trainer.dtype),
    )
    record.write(out / "fairness.json")
    return record.fair


#: the steps ``breakdown`` profiles (after six warm-up steps, as train counts them; with the torch
#: profiler ``--profile-step-start 7 --profile-step-end 9`` records them, as in Megatron-LM)
PROFILED = (7, 8)


def breakdown(out: Path, matrix_path: Path | None = None, device: str = CUDA) -> bool:
    """Where :data:`FAIRNESS_RUN`'s step time goes, beside its plain twin's: ``megatron-npu
    train --profile --use-pytorch-profiler`` of steps 7-8 of the row (``profile/train/``: the
    Chrome trace and ``summary-rank0.json``) and the twin's steps 7-8 under the same profiler
    (``profile/plain-summary.json``). Kernel time a smaller share of the wall time than the twin's
    points at host work (launches, reads that wait for the device); the summaries' kernels at
    the device's. Ok when both summaries were written."""
    from megatron_npu.devices.facts import facts
    from megatron_npu.training import profiling

    row = _fairness_row(matrix_path or _matrix_of(out))
    folder = out / "profile"
    shutil.rmtree(folder, ignore_errors=True)  # never read an earlier run's files
    _train_row(
        out, row, device, "profile-run",
        "--train-iters", str(PROFILED[-1]), "--profile", "--use-pytorch-profiler",
        "--profile-step-start", str(PROFILED[0]), "--profile-step-end", str(PROFILED[-1] + 1),
        "--profile-dir", str(folder / "train"),
    )  # fmt: skip
    trainer = _twin(row[1], device)
    _timed_steps(trainer, PROFILED[0] - 1, device)
    with profiling.recorder(facts(device)) as prof:
        wall = _timed_steps(trainer, len(PROFILED), device)
    plain = profiling.summarize(
        prof, what="plain PyTorch twin", device=device, steps=PROFILED, wall_s=wall
    )
    plain.write(folder / "plain-summary.json")
    return (folder / "train" / "summary-rank0.json").is_file()


#: the check's parts, in the order they run
PARTS = ("machine", "attention", "compare", "fairness", "breakdown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--megatron-lm",
        type=Path,
        default=None,
        help="a Megatron-LM checkout (its pretrain_gpt.py is run on cuda)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="run these parts alone (fairness reads the compare part's run of its row when there "
        "is one, else runs the row itself)",
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        default=[],
        metavar="NAME",
        help="the compare part runs only these rows of its matrix, and those they are judged "
        "against",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing to check", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    parts = {
        "machine": lambda: machine(args.out) or True,
        "attention": lambda: attention(args.out),
        "compare": lambda: compare(args.out, args.megatron_lm, args.runs),
        "fairness": lambda: fairness(args.out),
        "breakdown": lambda: breakdown(args.out),
    }
    for name, part in ((n, parts[n]) for n in PARTS if n in args.only):
        start = time.perf_counter()
        try:
            ok = part()
        except Exception:
            traceback.print_exc()
            ok = False
        print(
            f"gpu_check: {name}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        if not ok:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
