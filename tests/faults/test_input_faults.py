"""Every input fault gives one named error before any rank starts.

Each case runs ``megatron_npu.train.main`` in-process with ``--nproc-per-node 2`` and the launcher
replaced by a tripwire: the fault must be reported (exit status 2, the flag/file/field named,
the remedy given, printed once, no traceback) *without* starting ranks. The control case (the
same command on the intact inputs) reaches the launcher, so each case fails for its own fault.
After every checkpoint fault the last good checkpoint (iteration 2) still passes the checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest

from megatron_npu import train
from megatron_npu.data.tokenizers import null_tokenizer
from megatron_npu.training import checkpoint_store, launch

from ._harness import TINY, write_indexed_dataset

LAUNCHED = "ranks were started"


def run_main(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    for key in (
        "RANK",
        "WORLD_SIZE",
        "MEGATRON_NPU_PREFLIGHT_DONE",
        "TORCHELASTIC_ERROR_FILE",
        "MEGATRON_NPU_LAUNCHER_PID",
    ):
        monkeypatch.delenv(key, raising=False)

    def tripwire(_argv, _args):
        raise AssertionError(LAUNCHED)

    monkeypatch.setattr(launch, "launch", tripwire)
    try:
        code = train.main([*argv, "--nproc-per-node", "2"])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# --- the inputs: each case returns the argv of a run with one fault ----------------------------


def _data(tmp: Path, corrupt=None) -> list[str]:
    prefix = write_indexed_dataset(tmp / "corpus")
    if corrupt:
        corrupt(Path(f"{prefix}.idx"), Path(f"{prefix}.bin"))
    return [
        *[a for a in TINY if a != "--mock-data"],
        "--tokenizer-type",
        "ByteLevel",
        "--data-path",
        str(prefix),
    ]


def _empty_dataset(tmp: Path) -> str:
    """The dataset `megatron-npu preprocess` writes for an empty JSONL (0 documents)."""
    from megatron_npu.data.preprocess import preprocess
    from megatron_npu.data.tokenizers import ByteLevelTokenizer

    (tmp / "empty.jsonl").write_text("")
    return preprocess([str(tmp / "empty.jsonl")], str(tmp / "empty"), ByteLevelTokenizer())[
        "prefix"
    ]


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _ckpt(tmp: Path, good: Path, corrupt=None, *extra: str) -> list[str]:
    copy = tmp / "ckpt"
    shutil.copytree(good, copy)
    if corrupt:
        corrupt(copy)
    return [*TINY, "--load", str(copy), *extra]


def _shard(ckpt: Path, iteration: int = 4) -> Path:
    return sorted((ckpt / f"iter_{iteration:07d}").glob("*.distcp"))[0]


def _flip_400(ckpt: Path) -> None:
    shard = _shard(ckpt)
    raw = bytearray(shard.read_bytes())
    for i in range(400):
        raw[100 + i] ^= 0xFF
    shard.write_bytes(bytes(raw))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _crafted_metadata(ckpt: Path) -> None:
    """A .metadata whose pickle calls os.system, with the manifest's checksum updated to match
    (an attacker who writes the checkpoint writes the manifest too)."""
    directory = ckpt / "iter_0000004"
    (directory / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest_path = directory / checkpoint_store.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    data = (directory / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    manifest_path.write_text(json.dumps(manifest))


def _crafted_common(ckpt: Path) -> None:
    """A common.pt (a torch zip) whose pickle calls os.system, the manifest updated to match."""
    import torch

    directory = ckpt / "iter_0000004"
    torch.save({"iteration": 4, "x": _Evil()}, directory / "common.pt")
    manifest_path = directory / checkpoint_store.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    data = (directory / "common.pt").read_bytes()
    manifest["files"]["common.pt"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    manifest_path.write_text(json.dumps(manifest))


def _negative_size(ckpt: Path) -> None:
    """A manifest that parses as JSON but not as a manifest (a size below zero). The entry is
    torch_dist's `.metadata`, which every release writes (0.19 writes no common.pt)."""
    manifest_path = ckpt / "iter_0000004" / checkpoint_store.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][".metadata"]["bytes"] = -1
    manifest_path.write_text(json.dumps(manifest))


def _no_manifest(ckpt: Path) -> None:
    (ckpt / "iter_0000004" / checkpoint_store.MANIFEST).unlink()


def _with(flag: str, value: str) -> list[str]:
    argv = list(TINY)
    argv[argv.index(flag) + 1] = value
    return argv


ARG_FAULTS = {
    "nan-lr": (lambda t, g: _with("--lr", "nan"), r"argument --lr: must be a finite number"),
    "inf-clip-grad": (
        lambda t, g: [*TINY, "--clip-grad", "inf"],
        r"argument --clip-grad: must be a finite",
    ),
    "dropout-2": (
        lambda t, g: [*TINY, "--hidden-dropout", "2"],
        r"--hidden-dropout 2 is out of range",
    ),
    "attention-dropout-negative": (
        lambda t, g: [*TINY, "--attention-dropout", "-0.1"],
        r"--attention-dropout -0.1 is out of range",
    ),
    "bad-master-port": (
        lambda t, g: [*TINY, "--master-port", "70000"],
        r"--master-port 70000 is not a TCP port",
    ),
    "ckpt-step-without-load": (
        lambda t, g: [*TINY, "--ckpt-step", "2"],
        r"--ckpt-step needs --load",
    ),
    # Megatron's scheduler asserts lr_warmup_steps < lr_decay_steps
    "lr-warmup-beyond-train-iters": (
        lambda t, g: [*TINY, "--lr-warmup-iters", "10"],
        r"--lr-warmup-iters 10 must be smaller than --train-iters 4",
    ),
    "lr-warmup-equals-decay-iters": (
        lambda t, g: [*TINY, "--lr-warmup-iters", "3", "--lr-decay-iters", "3"],
        r"--lr-warmup-iters 3 must be smaller than --lr-decay-iters 3",
    ),
}

DATA_FAULTS = {
    "missing-data-prefix": (
        lambda t, g: [*_data(t)[:-1], str(t / "nowhere")],
        r"--data-path .*nowhere: no .*nowhere\.idx",
    ),
    "truncated-bin": (
        lambda t, g: _data(t, lambda idx, b: _truncate(b, 100)),
        r"corpus\.bin: truncated: 100 bytes, its index .* needs 480",
    ),
    "idx-bad-magic": (
        lambda t, g: _data(t, lambda idx, b: _patch(idx, 0, b"XXIDIDX")),
        r"corpus\.idx: bad magic",
    ),
    "idx-bad-version": (
        lambda t, g: _data(t, lambda idx, b: _patch(idx, 9, struct.pack("<Q", 7))),
        r"corpus\.idx: unsupported version 7",
    ),
    "idx-bad-dtype": (
        lambda t, g: _data(t, lambda idx, b: _patch(idx, 17, b"\x63")),
        r"corpus\.idx: unknown dtype code 99",
    ),
    "idx-truncated": (
        lambda t, g: _data(t, lambda idx, b: _truncate(idx, 60)),
        r"corpus\.idx: truncated: 60",
    ),
    "idx-truncated-header": (
        lambda t, g: _data(t, lambda idx, b: _truncate(idx, 20)),
        r"corpus\.idx: truncated header",
    ),
    "idx-counts-inconsistent": (  # sizes say 40 tokens, pointers say otherwise
        lambda t, g: _data(t, lambda idx, b: _patch(idx, 34, struct.pack("<i", 41))),
        r"corpus\.idx: sequence pointers disagree with the sequence lengths",
    ),
    "empty-dataset": (  # what `megatron-npu preprocess` writes for an empty JSONL
        lambda t, g: [*_data(t)[:-1], _empty_dataset(t)],
        r"--data-path .*empty_text_document: the dataset is empty \(0 sequences, 0 tokens\)",
    ),
    "idx-document-count-inconsistent": (
        lambda t, g: _data(t, lambda idx, b: _patch(idx, 26, struct.pack("<Q", 9))),
        r"corpus\.idx: (truncated|document indices are inconsistent)",
    ),
}

CKPT_FAULTS = {
    "load-missing-dir": (
        lambda t, g: [*TINY, "--load", str(t / "absent")],
        r"--load .*absent: no such directory; .*--load-optional",
    ),
    "load-dir-without-checkpoint": (
        lambda t, g: [*TINY, "--load", str(t)],
        r"holds no checkpoint .*--load-optional",
    ),
    "garbage-tracker": (
        lambda t, g: _ckpt(
            t, g, lambda c: (c / checkpoint_store.TRACKER).write_bytes(b"\x00garbage\xff")
        ),
        r"tracker .*latest_checkpointed_iteration\.txt (holds|cannot be read).*--ckpt-step",
    ),
    "tracker-names-missing-iteration": (
        lambda t, g: _ckpt(t, g, lambda c: (c / checkpoint_store.TRACKER).write_text("7\n")),
        r"iter_0000007 \(named by latest_checkpointed_iteration\.txt\) does not exist",
    ),
    "ckpt-step-missing": (
        lambda t, g: _ckpt(t, g, None, "--ckpt-step", "3"),
        r"iter_0000003 \(named by --ckpt-step 3\) does not exist",
    ),
    "truncated-shard": (
        lambda t, g: _ckpt(t, g, lambda c: _truncate(_shard(c), 1000)),
        r"__0_0\.distcp is truncated: 1000 bytes.*--ckpt-step N \(present: 2\)",
    ),
    "empty-shard": (
        lambda t, g: _ckpt(t, g, lambda c: _truncate(_shard(c), 0)),
        r"__0_0\.distcp is empty",
    ),
    "bit-flipped-shard-400-bytes": (
        lambda t, g: _ckpt(t, g, _flip_400),
        r"__0_0\.distcp is corrupted: its SHA-256 differs",
    ),
    "missing-shard": (
        lambda t, g: _ckpt(t, g, lambda c: _shard(c).unlink()),
        r"__0_0\.distcp is missing",
    ),
    "missing-metadata": (
        lambda t, g: _ckpt(t, g, lambda c: (c / "iter_0000004" / ".metadata").unlink()),
        r"iter_0000004 has no \.metadata",
    ),
    "garbage-manifest": (
        lambda t, g: _ckpt(
            t, g, lambda c: (c / "iter_0000004" / checkpoint_store.MANIFEST).write_text("{nope")
        ),
        r"manifest .* is unreadable",
    ),
    "malformed-manifest": (
        lambda t, g: _ckpt(t, g, _negative_size),
        r"manifest .*megatron_npu_checkpoint\.json: files\.\.metadata\.bytes: input should be "
        r"greater than or equal to 0 \(got -1\): the checkpoint cannot be verified",
    ),
    "other-hidden-size": (
        lambda t, g: [*_ckpt(t, g), "--hidden-size", "64"],
        r"another model: hidden_size is 32 there, 64 in this run \(set by --hidden-size\)",
    ),
    "other-num-layers": (
        lambda t, g: [*_ckpt(t, g), "--num-layers", "4"],
        r"another model: num_layers is 2 there, 4 in this run",
    ),
    "other-vocab": (
        lambda t, g: [*_ckpt(t, g), "--vocab-size", "300"],
        # the tokenizer's size: TINY's 256 ids, and what --vocab-size 300 builds
        rf"another model: vocab_size is 256 there, {null_tokenizer(300).vocab_size} in this run",
    ),
    "other-qk-layernorm": (
        lambda t, g: [*_ckpt(t, g), "--qk-layernorm"],
        r"another model: qk_layernorm is False there, True in this run \(set by --qk-layernorm",
    ),
    "other-layer-spec": (
        lambda t, g: [*_ckpt(t, g), "--transformer-impl", "transformer_engine"],
        r"another model: transformer_impl is local there, transformer_engine in this run \(set "
        r"by --transformer-impl",
    ),
    "optimizer-kind-changed": (
        lambda t, g: [*_ckpt(t, g), "--use-distributed-optimizer"],
        r"iter_0000004 was saved without --use-distributed-optimizer.*--no-load-optim",
    ),
    "train-iters-changed": (
        lambda t, g: [*_ckpt(t, g), "--train-iters", "8"],
        r"--train-iters 8 differs from the checkpoint's 4.*--override-opt_param-scheduler",
    ),
    "unsafe-pickle-in-metadata": (
        lambda t, g: _ckpt(t, g, _crafted_metadata),
        r"metadata .*\.metadata refers to posix\.system, which safe load refuses.*--no-safe-load",
    ),
    "save-is-a-file": (lambda t, g: [*TINY, "--save", str(Path(__file__))], r"--save .* is a file"),
    # no manifest = no checksums; refused unless --allow-unverified-load
    "manifest-deleted": (
        lambda t, g: _ckpt(t, g, _no_manifest),
        r"iter_0000004 has no megatron_npu_checkpoint\.json: .*cannot be verified; pass "
        r"--allow-unverified-load",
    ),
    "manifest-deleted-and-shard-flipped": (
        lambda t, g: _ckpt(t, g, lambda c: (_no_manifest(c), _flip_400(c))),
        r"iter_0000004 has no megatron_npu_checkpoint\.json.*--allow-unverified-load",
    ),
    "unsafe-pickle-in-common-pt": (
        lambda t, g: _ckpt(t, g, _crafted_common),
        r"common\.pt holds more than tensors and plain data, which safe load refuses \(Trying "
        r"to load unsupported GLOBAL posix\.system\); load only checkpoints you trust; for a "
        r"trusted one pass --no-safe-load$",
    ),
}

FAULTS = {**ARG_FAULTS, **DATA_FAULTS, **CKPT_FAULTS}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_one_named_error_before_any_rank(
    name, tmp_path, good_checkpoint, capsys, monkeypatch
):
    build, expected = FAULTS[name]
    code, out = run_main(build(tmp_path, good_checkpoint), capsys, monkeypatch)
    assert code == 2, out
    assert LAUNCHED not in out and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out  # printed once
    assert re.search(expected, errors[0]), (expected, out)
    if name in CKPT_FAULTS:  # the last good checkpoint still passes every check
        copy = tmp_path / "ckpt"
        if copy.is_dir():
            ok = [*TINY, "--load", str(copy), "--ckpt-step", "2"]
            with pytest.raises(AssertionError, match=LAUNCHED):
                run_main(ok, capsys, monkeypatch)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--ckpt-step", "2"],
        ["--train-iters", "8", "--override-opt_param-scheduler"],
        ["--train-iters", "8", "--use-checkpoint-opt_param-scheduler"],
        ["--train-iters", "8", "--no-load-optim"],
    ],
)
def test_control_intact_inputs_reach_the_launcher(
    extra, tmp_path, good_checkpoint, capsys, monkeypatch
):
    with pytest.raises(AssertionError, match=LAUNCHED):
        run_main(_ckpt(tmp_path, good_checkpoint, None, *extra), capsys, monkeypatch)
    with pytest.raises(AssertionError, match=LAUNCHED):
        run_main(_data(tmp_path), capsys, monkeypatch)


def test_load_optional_starts_fresh(tmp_path, capsys, monkeypatch):
    with pytest.raises(AssertionError, match=LAUNCHED):
        run_main(
            [*TINY, "--load", str(tmp_path / "absent"), "--load-optional"], capsys, monkeypatch
        )
    assert "error" not in capsys.readouterr().err


@contextlib.contextmanager
def _unprivileged():
    """Drop to an unprivileged effective uid while inside (root ignores directory modes)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_read_only_save_dir(tmp_path, capsys, monkeypatch):
    save = tmp_path / "ro"
    save.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(save, 0o555)
    with _unprivileged():
        code, out = run_main([*TINY, "--save", str(save)], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in out
    assert f"--save {save} is not writable" in out and "Permission denied" in out, out


def test_metrics_json_is_strict_even_for_a_diverged_step(tmp_path):
    from megatron_npu.training import metrics

    run_metrics = metrics.RunMetrics({"arguments": {}, "device": "cpu"}, tokens_per_step=64)
    for step, loss in ((1, 5.0), (2, float("nan")), (3, float("inf"))):
        run_metrics.add(
            metrics.StepRecord(
                step=step,
                lm_loss=loss,
                grad_norm=float("nan"),
                lr=1e-3,
                loss_scale=1.0,
                skipped=False,
                step_time_s=0.1,
                tokens_per_s=640.0,
            )
        )
    path = tmp_path / "metrics.json"
    run_metrics.write(str(path))

    def refuse(token):
        raise ValueError(token)

    data = json.loads(path.read_text(), parse_constant=refuse)
    assert [s["lm_loss"] for s in data["steps"]] == [5.0, None, None]
    assert not list(tmp_path.glob(".metrics.json.tmp*"))  # the temp file was renamed away
