"""Checks of a run's inputs before any rank starts: the ``--master-port``, data files, tokenizer
files, the ``--save`` directory and the ``--load``
checkpoint (tracker, manifest -- refused without one unless ``--allow-unverified-load`` --,
model fingerprint, LR schedule, per-file SHA-256, safe-load ``.metadata`` and the common state).

:func:`check` runs in the launcher process (``--nproc-per-node``), or in the one process of a
single-rank run, or in every rank under torchrun. Each fault raises
:class:`~megatron_npu.training.errors.TrainingInputError` naming the flag, file or field, so the
launcher prints one message and exits 2 without starting ranks. Nothing here imports
Megatron-Core (only ``--data-path`` runs resuming a checkpoint build their tokenizer, to learn
its vocabulary size; token ids are checked against the tokenizer by the ranks, in
``training.data``).
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from argparse import Namespace

from megatron_npu.data.index_check import check_indexed_dataset
from megatron_npu.training import checkpoint_store as store
from megatron_npu.training import safe_load
from megatron_npu.training.errors import TrainingInputError, port_in_use

#: Set by the launcher for its ranks: the checks already ran there.
DONE_ENV = "MEGATRON_NPU_PREFLIGHT_DONE"


def data_prefixes(data_path: list[str]) -> list[str]:
    """The prefixes of Megatron's ``--data-path [W1] P1 [W2] P2 ...`` (weights dropped)."""

    def is_weight(item: str) -> bool:
        try:
            float(item)
        except ValueError:
            return False
        return True

    if len(data_path) > 1 and is_weight(data_path[0]):
        return list(data_path[1::2])
    return list(data_path)


def check_data(args: Namespace) -> None:
    for flag in ("vocab_file", "merge_file"):
        value = getattr(args, flag)
        if value and not os.path.isfile(value):
            raise TrainingInputError(f"--{flag.replace('_', '-')} {value}: no such file")
    for prefix in data_prefixes(list(args.data_path or [])):
        check_indexed_dataset(prefix)


def _port_taken(host: str, port: int) -> bool:
    """Whether binding ``host:port`` as the rendezvous store does (SO_REUSEADDR) fails because
    the port is in use; False where ``host`` is not an address of this machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def check_port(args: Namespace) -> None:
    """``--master-port`` is free on this machine (where the launcher, or a single rank, will
    serve the run's store), so a second run on a busy port gets a named error before anything
    starts. Skipped under torchrun (its agent owns the port) and on nodes other than 0."""
    if "RANK" in os.environ or args.master_port is None or args.node_rank != 0:
        return
    for host in dict.fromkeys(("0.0.0.0", args.master_addr)):
        try:
            taken = _port_taken(host, args.master_port)
        except (OSError, socket.gaierror):
            taken = False  # not resolvable here: another host's address
        if taken:
            raise port_in_use(args.master_port)


def check_save(args: Namespace) -> None:
    """``--save`` (or the nearest existing folder above it) accepts a new file."""
    if not args.save:
        return
    probe_dir = os.path.abspath(args.save)
    if os.path.exists(probe_dir) and not os.path.isdir(probe_dir):
        raise TrainingInputError(f"--save {args.save} is a file, not a directory")
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    try:
        fd, probe = tempfile.mkstemp(prefix=".megatron-npu-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise TrainingInputError(
            f"--save {args.save} is not writable ({probe_dir}: {exc.strerror})",
            "give a directory this user can write, on a writable file system",
        ) from None


def tokenizer_vocab_size(args: Namespace) -> int:
    """The vocabulary the run's tokenizer has (what :mod:`.data` builds), before padding."""
    from megatron_npu.data.tokenizers import ByteLevelTokenizer, build_tokenizer, null_tokenizer

    if args.mock_data:
        return int(null_tokenizer(args.vocab_size).vocab_size)

    if not args.data_path:
        return int(ByteLevelTokenizer().vocab_size)
    try:
        return int(
            build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file).vocab_size
        )
    except (OSError, ValueError) as exc:
        raise TrainingInputError(
            f"--tokenizer-type {args.tokenizer_type} cannot be built from --vocab-file "
            f"{args.vocab_file} / --merge-file {args.merge_file}: {exc}"
        ) from None


def check_load(args: Namespace) -> str | None:
    """Verify the checkpoint ``--load`` (``--ckpt-step``) names; returns a note to print, if any.
    ``args`` must be finalized (the global batch size is part of the LR schedule)."""
    root = args.load
    if not root:
        return None
    start_fresh = "pass --load-optional to start from scratch instead"
    if not os.path.isdir(root):
        if args.load_optional:
            return None  # rank 0 says it starts from scratch
        raise TrainingInputError(
            f"--load {root}: no such directory", f"check the path, or {start_fresh}"
        )
    iteration = args.ckpt_step if args.ckpt_step is not None else store.read_tracker(root)
    if iteration is None:
        if args.load_optional:
            return None
        raise TrainingInputError(
            f"--load {root} holds no checkpoint (no {store.TRACKER})", start_fresh
        )
    path = store.iteration_dir(root, iteration)
    if not os.path.isdir(path):
        named_by = f"--ckpt-step {iteration}" if args.ckpt_step is not None else store.TRACKER
        raise TrainingInputError(
            f"checkpoint {path} (named by {named_by}) does not exist",
            store.remedy_other_iteration(root, iteration),
        )
    metadata = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata):
        raise TrainingInputError(
            f"checkpoint {path} has no .metadata: not a complete torch_dist checkpoint",
            store.remedy_other_iteration(root, iteration),
        )
    manifest = store.read_manifest(path)
    if manifest is not None:
        here = store.fingerprint(args, tokenizer_vocab_size(args))
        store.check_fingerprint(path, manifest.fingerprint, here)
        if manifest.scheduler is not None:  # saved with its optimizer state
            saved_distopt = manifest.arguments.use_distributed_optimizer
            if saved_distopt is not None:
                store.check_optimizer_kind(path, saved_distopt, args)
            if not args.no_load_optim:
                store.check_schedule(path, manifest, args)
        store.verify_files(path, manifest)
    elif not args.allow_unverified_load:
        raise TrainingInputError(
            f"checkpoint {path} has no {store.MANIFEST}: its files' checksums and its model "
            "fingerprint cannot be verified",
            "pass --allow-unverified-load to load it anyway (a checkpoint from Megatron-LM, or "
            "one you trust), or " + store.remedy_other_iteration(root, iteration),
        )
    if args.safe_load:
        safe_load.check_metadata(metadata)
        safe_load.check_common(path)
    if manifest is None:
        return (
            f" checkpoint {path} has no {store.MANIFEST}: loading it without checksum or "
            "model-fingerprint verification (--allow-unverified-load)"
        )
    return None


def check(args: Namespace) -> list[str]:
    """Every pre-start check; returns the notes to print (raises on a fault)."""
    check_port(args)
    check_data(args)
    check_save(args)
    note = check_load(args)
    return [note] if note else []
