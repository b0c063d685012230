"""Safe load: a ``--load`` checkpoint may hold tensors and checkpoint metadata, not code.

torch's distributed-checkpoint reader ``pickle.load``s the checkpoint's ``.metadata`` and its
default load planner ``torch.load(..., weights_only=False)``s every object shard (Megatron's
``ShardedObject``s: the RNG states, layers' extra state). Both run arbitrary code from a crafted
checkpoint. Safe load (the default; ``--no-safe-load`` turns it off for trusted checkpoints whose
objects need more) closes both:

* :func:`check_metadata` unpickles ``.metadata`` with an allow-list (:data:`ALLOWED`): torch's
  checkpoint metadata classes, megatron-core's plain-data ones, ``torch.Size``,
  dtypes/layouts/memory formats and plain builtins;
  any other global is refused naming it, before any rank starts;
* :func:`check_common` loads the checkpoint's common state (iteration, schedule, layout) with
  ``weights_only=True`` before any rank starts, so a crafted one is refused at once, whole (the
  optimizer classes an ``--optimizer-cpu-offload`` checkpoint records are allowed);
* :func:`restricted_objects` makes the object shards load with ``weights_only=True`` (tensors,
  plain containers, and the numpy pieces of numpy's RNG state) while a checkpoint loads: the
  patch of ``DefaultLoadPlanner.load_bytes`` exists only inside that context and the class is
  pristine again when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import re
import warnings

from megatron_npu.training.errors import TrainingInputError

_BUILTINS = frozenset(
    {
        "set",
        "frozenset",
        "slice",
        "list",
        "dict",
        "tuple",
        "bytes",
        "bytearray",
        "int",
        "float",
        "str",
        "bool",
        "complex",
        "range",
    }
)


#: the classes megatron-core's torch_dist format pickles into ``.metadata``
MCORE_METADATA_CLASSES = ("MCoreSavePlan", "MCoreMetadata")


def _allowed(module: str, name: str) -> bool:
    import torch

    if module == "builtins":
        return name in _BUILTINS
    if module == "collections":
        return name in ("OrderedDict", "defaultdict")
    if module == "torch":
        if name == "Size":
            return True
        value = getattr(torch, name, None)
        return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    if module == "torch.serialization":
        return name == "_get_layout"
    if module == "megatron.core.dist_checkpointing.strategies.torch":
        # plain data: up to megatron-core 0.14 its torch_dist plan, in 0.15 its metadata (torch's
        # Metadata and a dict of shapes); later releases keep both names as empty classes so that
        # such checkpoints still load
        return name in MCORE_METADATA_CLASSES
    if module.startswith("torch.distributed.checkpoint."):
        value = getattr(importlib.import_module(module), name, None)
        return isinstance(value, type)  # metadata classes and enums, never functions
    return False


#: What :func:`check_metadata` accepts, described for the error message.
ALLOWED = (
    "torch.distributed.checkpoint classes, megatron-core's "
    + " and ".join(MCORE_METADATA_CLASSES)
    + ", torch.Size, torch dtypes/layouts/memory formats, collections.OrderedDict and plain "
    "builtin containers"
)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def check_metadata(path: str) -> None:
    """Unpickle ``path`` (a checkpoint's ``.metadata``) with the allow-list; refuse otherwise."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        _RestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise TrainingInputError(
            f"checkpoint metadata {path} refers to {exc}, which safe load refuses (it could run "
            f"code on --load; allowed: {ALLOWED})",
            "load only checkpoints you trust; for a trusted one pass --no-safe-load",
        ) from None
    except Exception as exc:  # truncated or not a pickle at all
        raise TrainingInputError(
            f"checkpoint metadata {path} is unreadable ({exc.__class__.__name__}: {exc})",
            "load another iteration with --ckpt-step N",
        ) from None


#: The sentence of torch's ``weights_only`` refusal that names what was refused.
_REFUSED = re.compile(r"(Trying to load unsupported GLOBAL [^\s]+|Unsupported [^\n]+)")
COMMON_FILE = "common.pt"


def refusal_detail(exc: BaseException) -> str:
    """What torch's ``weights_only`` unpickler refused, as one whole phrase (its message is a
    long paragraph about PyTorch 2.6 defaults)."""
    text = str(exc)
    found = _REFUSED.search(text)
    if found:
        return found.group(1).strip().rstrip(".")
    return (text.strip().splitlines() or [exc.__class__.__name__])[0]


@contextlib.contextmanager
def also_allowed(extra: list):
    """``torch.serialization.safe_globals`` for the globals of ``extra`` not already allowed
    process-wide: torch's context takes away what it added when it ends, which would remove
    another's registration of the same global (megatron-core registers numpy's pieces at
    import)."""
    import torch

    registered = torch.serialization.get_safe_globals()
    with torch.serialization.safe_globals([g for g in extra if g not in registered]):
        yield


def check_common(path: str) -> None:
    """Load checkpoint directory ``path``'s common state with ``weights_only=True`` (what
    Megatron-Core's loader does later, in every rank), the optimizer classes an
    ``--optimizer-cpu-offload`` checkpoint records allowed; refuse it naming what it holds. The
    common state is ``common.pt``, or from megatron-core 0.19 an object shard of the torch_dist
    checkpoint, read through megatron-core's own loader with object shards restricted
    (:func:`restricted_objects`: torch's planner would unpickle the shard with
    ``weights_only=False``)."""
    import torch

    from megatron_npu.optim.recorded_classes import recorded_optimizer_classes
    from megatron_npu.patcher import megatron_core_below

    file = os.path.join(path, COMMON_FILE)
    if os.path.isfile(file):
        what = f"checkpoint file {file}"

        def load() -> None:
            torch.load(file, map_location="cpu", weights_only=True)

    elif not megatron_core_below("0.19"):
        what = f"checkpoint {path}'s common state"

        def load() -> None:
            from megatron.core import dist_checkpointing

            # the launcher reads it in one process, which torch warns about on every read
            with restricted_objects(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dist_checkpointing.load_common_state_dict(path)

    else:
        raise TrainingInputError(
            f"checkpoint {path} has no {COMMON_FILE}: not a complete torch_dist checkpoint",
            "load another iteration with --ckpt-step N",
        )
    try:
        with also_allowed(recorded_optimizer_classes()):
            load()
    except Exception as exc:
        raise _common_refused(what, exc) from None
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException
        if not isinstance(getattr(exc, "failures", None), dict):
            raise
        raise _common_refused(what, first_rank_failure(exc)) from None


def _common_refused(what: str, exc: BaseException) -> TrainingInputError:
    if isinstance(exc, TrainingInputError):  # an object shard refused by restricted_objects
        return exc
    if isinstance(exc, pickle.UnpicklingError):
        return TrainingInputError(
            f"{what} holds more than tensors and plain data, which safe load refuses "
            f"({refusal_detail(exc)})",
            "load only checkpoints you trust; for a trusted one pass --no-safe-load",
        )
    return TrainingInputError(  # truncated, or not a torch file at all
        f"{what} is unreadable ({exc.__class__.__name__}: {refusal_detail(exc)})",
        "load another iteration with --ckpt-step N",
    )


def first_rank_failure(exc: BaseException) -> BaseException:
    """The first rank's own exception inside torch.distributed.checkpoint's
    ``CheckpointException`` (whose message names only the ranks): ``failures`` maps each rank
    to its (exception, stack) pair."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, BaseException):
                return inner
    return exc


def _numpy_rng_globals() -> list:
    import numpy as np

    # numpy 2 moved its core to numpy._core; numpy 1 (which megatron-core up to 0.14 asks for)
    # keeps numpy.core, and a shim numpy._core without multiarray
    major = int(np.__version__.split(".")[0])
    multiarray = importlib.import_module(
        "numpy._core.multiarray" if major >= 2 else "numpy.core.multiarray"
    )
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


@contextlib.contextmanager
def restricted_objects():
    """While active, torch's default load planner reads object shards with
    ``weights_only=True`` (numpy's RNG-state pieces allowed)."""
    import torch
    from torch.distributed.checkpoint import default_planner

    planner = default_planner.DefaultLoadPlanner
    original = planner.load_bytes
    numpy_globals = _numpy_rng_globals()

    def load_bytes(self, read_item, value):  # DefaultLoadPlanner.load_bytes, weights only
        try:
            with also_allowed(numpy_globals):
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise TrainingInputError(
                f"checkpoint object {read_item.dest_index.fqn} holds more than tensors and plain "
                f"data, which safe load refuses ({refusal_detail(exc)})",
                "load only checkpoints you trust; for a trusted one pass --no-safe-load",
            ) from None
        if self.flatten_state_dict:
            fqn = self.mappings[read_item.dest_index.fqn]
            default_planner.set_element(self.original_state_dict, fqn, obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    planner.load_bytes = load_bytes
    try:
        yield
    finally:
        planner.load_bytes = original
