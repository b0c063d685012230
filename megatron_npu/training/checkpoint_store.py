"""What a checkpoint is on disk, and how it is committed and verified (pure Python: the launcher
checks a checkpoint with it before any rank starts).

Layout (Megatron-LM's, plus one file)::

    SAVE/latest_checkpointed_iteration.txt      "5"
    SAVE/iter_0000005/                          dist_checkpointing's torch_dist files
    SAVE/iter_0000005/megatron_npu_checkpoint.json   the manifest (below)

Crash safety: a save writes everything into ``SAVE/iter_0000005.partial/``, fsyncs it, writes the
manifest last, renames the directory to ``iter_0000005`` and only then replaces the tracker
(temp file + fsync + rename). A save that fails or is killed at any point leaves the tracker on
the previous checkpoint, which stays complete; a stale ``*.partial`` directory is removed by the
next save.

The manifest holds the model :func:`fingerprint` (weight shapes and vocabulary: a checkpoint of
another model is refused naming the field), the LR/WD schedule (a changed one is refused naming
the flag and Megatron's ``--override-opt_param-scheduler``) and every file's size and SHA-256
(a truncated, emptied or altered file is refused naming the file). Checkpoints without a manifest
(Megatron-LM's own, older ones, or one whose manifest was deleted) are refused by the launcher's
checks unless ``--allow-unverified-load``; with it they load unverified, with a note saying so.
The manifest's model is :class:`megatron_npu.formats.checkpoint_manifest.CheckpointManifest`
(schema ``docs/schemas/checkpoint-manifest.schema.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from argparse import Namespace
from pathlib import Path

from megatron_npu.files import fsync_dir, make_dir, write_private
from megatron_npu.formats import FormatError
from megatron_npu.formats.checkpoint_manifest import SCHEMA as MANIFEST_SCHEMA
from megatron_npu.formats.checkpoint_manifest import CheckpointManifest
from megatron_npu.moe_options import moe_layer_pattern
from megatron_npu.training import security
from megatron_npu.training.errors import TrainingInputError
from megatron_npu.training.schedule import FIELD_FLAGS, scheduler_settings

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "megatron_npu_checkpoint.json"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
_CHUNK = 1 << 20

#: Fingerprint fields and the flag that sets each (named when a checkpoint does not match).
FINGERPRINT_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "max_position_embeddings": "--max-position-embeddings (default --seq-length)",
    "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization",
    "swiglu": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "vocab_size": "the tokenizer (--vocab-size / --tokenizer-type / --vocab-file)",
    "padded_vocab_size": "--make-vocab-size-divisible-by x TP size",
    "transformer_impl": "--transformer-impl (the two specs name their layers differently)",
    "num_experts": "--num-experts (none: a dense model)",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_grouped_gemm": "--moe-grouped-gemm (the grouped experts hold their weights otherwise)",
    "moe_layer_freq": "--moe-layer-freq (which layers hold experts)",
    "qk_layernorm": "--qk-layernorm (the query/key norms' weights)",
    "multi_latent_attention": "--multi-latent-attention",
    "mla_shape": "--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, "
    "--v-head-dim",
}


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: a multiple of divisible-by x TP size."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


def fingerprint(args: Namespace, vocab_size: int) -> dict:
    """What decides the model's weight shapes (and what its token ids mean)."""
    return {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "ffn_hidden_size": args.ffn_hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "num_query_groups": args.num_query_groups,
        "kv_channels": args.kv_channels or args.hidden_size // args.num_attention_heads,
        "max_position_embeddings": args.max_position_embeddings,
        "position_embedding_type": args.position_embedding_type,
        "normalization": args.normalization,
        "swiglu": bool(args.swiglu),
        "add_bias_linear": not args.disable_bias_linear,
        "untie_embeddings_and_output_weights": bool(args.untie_embeddings_and_output_weights),
        "vocab_size": int(vocab_size),
        "padded_vocab_size": padded_vocab_size(
            int(vocab_size), args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
        "transformer_impl": getattr(args, "transformer_impl", "local"),
        "num_experts": getattr(args, "num_experts", None),
        "moe_ffn_hidden_size": getattr(args, "moe_ffn_hidden_size", None),
        "moe_shared_expert_intermediate_size": getattr(
            args, "moe_shared_expert_intermediate_size", None
        ),
        "moe_grouped_gemm": bool(getattr(args, "moe_grouped_gemm", False)),
        "moe_layer_freq": (
            moe_layer_pattern(args.moe_layer_freq, args.num_layers)
            if getattr(args, "num_experts", None)
            else None
        ),
        "qk_layernorm": bool(getattr(args, "qk_layernorm", False)),
        "multi_latent_attention": bool(getattr(args, "multi_latent_attention", False)),
        "mla_shape": (
            [
                args.q_lora_rank,
                args.kv_lora_rank,
                args.qk_head_dim,
                args.qk_pos_emb_head_dim,
                args.v_head_dim,
            ]
            if getattr(args, "multi_latent_attention", False)
            else None
        ),
    }


def iteration_dir(root: str | os.PathLike[str], iteration: int) -> str:
    return os.path.join(root, f"iter_{int(iteration):07d}")


def available_iterations(root: str | os.PathLike[str]) -> list[int]:
    """Complete-looking ``iter_*`` directories under ``root`` (partial saves excluded)."""
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("iter_") and name[5:].isdigit() and len(name) == 12:
                found.append(int(name[5:]))
    return sorted(found)


def remedy_other_iteration(root: str | os.PathLike[str], bad: int | str | None = None) -> str:
    others = [i for i in available_iterations(root) if i != bad]
    if others:
        listed = ", ".join(str(i) for i in others[-5:])
        return f"load another iteration with --ckpt-step N (present: {listed})"
    return "save a new checkpoint, or pass --load-optional to start from scratch"


def read_tracker(root: str | os.PathLike[str]) -> int | None:
    """The iteration ``root``'s tracker names, None when there is no tracker (Megatron's
    ``release`` checkpoints are not supported: they are refused like any non-number)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    try:
        text = Path(tracker).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainingInputError(
            f"checkpoint tracker {tracker} cannot be read ({exc.__class__.__name__})",
            remedy_other_iteration(root),
        ) from None
    if not text.isdigit():
        shown = text[:40] + ("..." if len(text) > 40 else "")
        raise TrainingInputError(
            f"checkpoint tracker {tracker} holds {shown!r}, not an iteration number",
            "write the iteration to resume from into it, or " + remedy_other_iteration(root),
        )
    return int(text)


def write_tracker(root: str | os.PathLike[str], iteration: int) -> None:
    write_private(os.path.join(root, TRACKER), f"{iteration}\n")
    fsync_dir(root)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: str) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), directory)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def partial_dir(root: str | os.PathLike[str], iteration: int) -> str:
    return iteration_dir(root, iteration) + PARTIAL_SUFFIX


def begin(root: str | os.PathLike[str], iteration: int) -> str:
    """A fresh, empty ``iter_N.partial`` directory to save into (stale ones are removed)."""
    path = partial_dir(root, iteration)
    make_dir(root)
    for name in os.listdir(root):  # what killed or failed saves left behind
        if name.startswith("iter_") and name.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    make_dir(path)
    return path


def commit(
    root: str | os.PathLike[str], iteration: int, manifest_fields: dict, *, fault=None
) -> str:
    """Finish a save written into :func:`partial_dir`: fsync every file, write the manifest
    (sizes, SHA-256s and ``manifest_fields``), rename to ``iter_N`` and point the tracker at it.
    ``fault`` (tests only) is called after the checksums, before anything is committed."""
    work = partial_dir(root, iteration)
    files = {}
    for rel in _files(work):
        path = os.path.join(work, rel)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    if fault is not None:
        fault(work)
    manifest = CheckpointManifest.parse(
        {
            "schema": MANIFEST_SCHEMA,
            "version": 1,
            "iteration": iteration,
            **manifest_fields,
            "files": files,
        },
        MANIFEST,
    )
    manifest.write(os.path.join(work, MANIFEST))
    security.harden_tree(work)
    for dirpath, _dirs, _names in os.walk(work):
        fsync_dir(dirpath)
    final = iteration_dir(root, iteration)
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(final):  # saving an iteration again (a re-run): keep the new one
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(work, final)
    fsync_dir(root)
    write_tracker(root, iteration)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def read_manifest(path: str | os.PathLike[str]) -> CheckpointManifest | None:
    """The manifest of checkpoint directory ``path`` (None if it has none); an unreadable or
    malformed one is a :class:`TrainingInputError` naming the file and what is wrong."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingInputError(
            f"checkpoint manifest {file} is unreadable ({exc.__class__.__name__}): the checkpoint "
            "cannot be verified",
            remedy_other_iteration(os.path.dirname(os.fspath(path)), None),
        ) from None
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
        raise TrainingInputError(f"checkpoint manifest {file} is not a megatron-npu manifest")
    try:
        return CheckpointManifest.parse(data, file)
    except FormatError as exc:
        raise TrainingInputError(
            f"checkpoint manifest {exc}: the checkpoint cannot be verified",
            remedy_other_iteration(os.path.dirname(os.fspath(path)), None),
        ) from None


def verify_files(path: str | os.PathLike[str], manifest: CheckpointManifest) -> None:
    """Every file the save wrote is there, whole and unchanged (size and SHA-256)."""
    root = os.path.dirname(os.fspath(path).rstrip(os.sep))
    iteration = manifest.iteration
    for rel, expected in sorted(manifest.files.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise TrainingInputError(
                f"checkpoint file {file} is missing", remedy_other_iteration(root, iteration)
            )
        size = os.path.getsize(file)
        if size != expected.bytes:
            what = "empty" if size == 0 else "truncated" if size < expected.bytes else "longer"
            raise TrainingInputError(
                f"checkpoint file {file} is {what}: {size} bytes, the save wrote {expected.bytes}",
                remedy_other_iteration(root, iteration),
            )
        if _sha256(file) != expected.sha256:
            raise TrainingInputError(
                f"checkpoint file {file} is corrupted: its SHA-256 differs from the one recorded "
                "at save time",
                remedy_other_iteration(root, iteration),
            )


def check_fingerprint(path: str | os.PathLike[str], saved: dict, here: dict) -> None:
    """Refuse a checkpoint of another model, naming the first field that differs."""
    for field, flag in FINGERPRINT_FLAGS.items():
        if field in saved and saved[field] != here.get(field):
            raise TrainingInputError(
                f"checkpoint {path} holds another model: {field} is {saved[field]} there, "
                f"{here.get(field)} in this run (set by {flag})",
                f"run with the checkpoint's {field}, or --load another checkpoint",
            )


def check_optimizer_kind(
    path: str | os.PathLike[str], saved_distopt: bool, args: Namespace
) -> None:
    """Megatron-core cannot load one optimizer kind's state into the other."""
    if args.no_load_optim or saved_distopt == bool(args.use_distributed_optimizer):
        return
    kind = "with" if saved_distopt else "without"
    raise TrainingInputError(
        f"{path} was saved {kind} --use-distributed-optimizer: megatron-core cannot load "
        "that optimizer state into the other optimizer kind",
        "match the flag, or pass --no-load-optim to take the model weights (and iteration) only",
    )


def check_schedule(
    path: str | os.PathLike[str], manifest: CheckpointManifest, args: Namespace
) -> None:
    """Megatron's ``OptimizerParamScheduler.load_state_dict`` asserts the saved schedule equals
    the command line's unless told which to use; say so before any rank starts."""
    saved = manifest.scheduler
    if not saved or args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    here = scheduler_settings(args)
    changed = [f for f in FIELD_FLAGS if f in saved and saved[f] != here[f]]
    if not changed:
        return
    saved_train_iters = manifest.arguments.train_iters
    detail = "; ".join(
        f"{f} {saved[f]} in the checkpoint, {here[f]} here (set by {FIELD_FLAGS[f]})"
        for f in changed
    )
    lead = ""
    if saved_train_iters not in (None, args.train_iters):
        lead = (
            f"--train-iters {args.train_iters} differs from the checkpoint's {saved_train_iters}: "
        )
    raise TrainingInputError(
        f"{lead}checkpoint {path} was saved with another LR/WD schedule ({detail})",
        "pass --override-opt_param-scheduler to use this command line's schedule, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's (Megatron's flags), or "
        "--no-load-optim to load the weights only",
    )
