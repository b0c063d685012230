"""Megatron-LM's training layer (``megatron.training``, ``megatron.legacy``): what its
``pretrain_gpt.py`` reaches beyond megatron-core on a non-CUDA device.

These targets live in Megatron-LM's repository, not in the megatron-core wheel: each entry
``requires`` that package and is ``not-installed`` where it is not importable. Everything else the
training layer does on the device goes through transparent mode (``import megatron_npu.auto``:
``torch.cuda.*``, ``device="cuda"``, the process group backend) and the megatron-core patches.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from typing import Any

from megatron_npu import console
from megatron_npu.context_parallel_options import comm_types_of, context_parallel_problems
from megatron_npu.moe_options import moe_option_problems
from megatron_npu.ops import settings
from megatron_npu.optim.recorded_classes import recorded_optimizer_classes
from megatron_npu.optimizer_options import (
    offload_problems,
    precision_aware_fp16_problems,
    sharded_optimizer_problems,
)
from megatron_npu.patches import megatron_fsdp, torch_fsdp2
from megatron_npu.recompute_options import recompute_problems_of
from megatron_npu.registry import Patch
from megatron_npu.training.safe_load import also_allowed

_logger = logging.getLogger(__name__)

CLIENT_TEST = "tests/megatron_lm/test_pretrain_gpt.py::test_pretrain_gpt_tp2_resume_is_bitwise"


def load_fused_kernels(args: Any) -> None:
    """Megatron-LM's CUDA kernel build (``megatron.legacy.fused_kernels.load``) has nothing to
    build here: nvcc does not exist on an NPU or CPU host, and the fused paths its flags ask for
    (masked softmax, bias-GELU/SwiGLU, rotary, flash attention, cross entropy) are served by the
    adaptor's patches of megatron-core."""
    _logger.info("megatron-npu: no CUDA fused kernels to build; the adaptor's ops serve them")


#: how long the other ranks wait before exiting on a refused option, so that rank 0's one line is
#: printed before torchrun tears the job down at the first rank's exit
_OTHER_RANKS_EXIT_AFTER_S = 5.0


class MegatronLMOptionError(SystemExit):
    """Megatron-LM options the adaptor refuses: one line, exit status 2. Each problem says why:
    the device cannot serve it, or Megatron's own code fails with it on any device."""

    header = "cannot run these Megatron-LM options"

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(2)

    def __str__(self) -> str:
        return f"megatron-npu: {self.header}: " + "; ".join(self.problems)


class MegatronLMOptionConflict(MegatronLMOptionError):
    """Megatron-LM options that cannot work together on any device: one line, exit status 2."""

    header = "these Megatron-LM options do not work together"


def _refuse(error: MegatronLMOptionError, *, every_rank: bool = True) -> None:
    """Rank 0 prints the error's one line; the other ranks wait for it; every rank exits 2.
    ``every_rank=False``: the error may be this rank's alone (a file only it reads), so a
    rank other than 0 says it too after the wait, unless torchrun has stopped it first at
    rank 0's exit."""
    if os.environ.get("RANK", "0") == "0":
        console.error(str(error))
    else:  # let rank 0 say it before torchrun stops the others at the first exit
        time.sleep(_OTHER_RANKS_EXIT_AFTER_S)
        if not every_rank:
            console.error(str(error))
    raise error


#: (argument name, the value that asks for it, the command-line option, why) of what the adaptor
#: cannot serve. Megatron's own defaults never trip these.
UNSUPPORTED: tuple[tuple[str, Any, str, str], ...] = (
    ("fp8", True, "--fp8-format", "fp8 GEMMs need Transformer Engine on Hopper/Blackwell GPUs"),
    ("tp_comm_overlap", True, "--tp-comm-overlap", "userbuffer GEMM overlap is a TE/CUDA feature"),
    ("external_cuda_graph", True, "--external-cuda-graph", "CUDA graphs do not exist here"),
    ("enable_cuda_graph", True, "--enable-cuda-graph", "CUDA graphs do not exist here"),
    ("cuda_graph_impl", "not-none", "--cuda-graph-impl", "CUDA graphs do not exist here"),
    (
        "moe_token_dispatcher_type",
        "flex",
        "--moe-token-dispatcher-type flex",
        "DeepEP / HybridEP dispatch is CUDA-only: use alltoall or allgather",
    ),
    (
        "moe_enable_deepep",
        True,
        "--moe-enable-deepep",
        "DeepEP dispatch is CUDA-only: use alltoall or allgather",
    ),
    *(
        (
            name,
            "fp8-dtype",
            f"{option} fp8",
            "fp8 optimizer moments are Transformer Engine Float8Tensor objects: the "
            "precision-aware optimizer keeps them in fp32, bf16 or fp16",
        )
        for name, option in (
            ("exp_avg_dtype", "--exp-avg-dtype"),
            ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"),
        )
    ),
    (
        "use_legacy_models",
        True,
        "--use-legacy-models",
        "the legacy models need apex's fused layer norm; the adaptor patches megatron-core models",
    ),
)


def unsupported_options(args: Any) -> list[str]:
    """Each option of ``args`` the adaptor cannot serve, as ``"--option: why"``."""
    found = []
    for name, trigger, option, why in UNSUPPORTED:
        value = getattr(args, name, None)
        hit = {
            "not-none": value not in (None, "none", "None"),
            "above-1": isinstance(value, int) and value > 1,
            "set": value is not None,
            # Megatron-LM's argument check maps "fp8" to torch.uint8
            "fp8-dtype": str(value) in ("fp8", "torch.uint8"),
        }.get(trigger, value == trigger if trigger is not True else bool(value))
        if hit:
            found.append(f"{option}: {why}")
    return found


def distributed_optimizer_problems(args: Any) -> list[str]:
    """What of Megatron-LM's ``args`` its distributed optimizer, the precision-aware optimizer
    and the hybrid optimizer it builds for ``--optimizer-cpu-offload`` cannot take (on any
    device), as ``"--option: why"``."""
    offloaded = bool(getattr(args, "optimizer_cpu_offload", False))
    return (
        sharded_optimizer_problems(
            getattr(args, "optimizer", "adam"),
            bool(
                getattr(args, "use_distributed_optimizer", False)
                or getattr(args, "use_megatron_fsdp", False)
            ),
            offloaded,
        )
        + offload_problems(
            offloaded, bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
        )
        + precision_aware_fp16_problems(
            bool(getattr(args, "use_precision_aware_optimizer", False)),
            bool(getattr(args, "fp16", False)),
            bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
            float(getattr(args, "clip_grad", 1.0) or 0.0),
        )
    )


def refusals(args: Any) -> list[str]:
    """Every option of Megatron-LM's ``args`` the adaptor refuses, as ``"--option: why"``: the
    ones it cannot serve and those Megatron's own code fails on (the distributed optimizer,
    FSDP2, Megatron-FSDP)."""
    return (
        unsupported_options(args)
        + distributed_optimizer_problems(args)
        + torch_fsdp2.problems(args)
        + megatron_fsdp.problems(args)
    )


def _warmup_in_forked_rng(original: Any) -> Any:
    """Megatron-LM warms its jit fusions up on random "cuda" tensors sized by the layout
    (``ffn_hidden_size // tp``). On CUDA those draws advance the device generator only; here the
    device generator *is* the host one, so the warm-up would shift the host stream that
    ``--use-cpu-initialization`` draws the master weights from, by an amount that depends on the
    TP size (a TP1 and a TP2 run would start from different weights). The warm-up's tensors are
    scratch, so it runs inside a forked RNG and leaves the generator as it found it."""

    @functools.wraps(original)
    def _warmup_jit_function(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    return _warmup_jit_function


def _set_global_variables(original: Any) -> Any:
    """Megatron-LM's validated arguments, before anything is built: refuse what the adaptor
    cannot serve (one named error), and hand the fused-attention choice (``--use-flash-attn``)
    to the attention patch as ``megatron-npu train`` does."""

    @functools.wraps(original)
    def set_global_variables(*args: Any, **kwargs: Any) -> Any:
        namespace = args[0] if args else kwargs["args"]
        problems = refusals(namespace)
        if problems:
            _refuse(MegatronLMOptionError(problems))
        if os.environ.get("RANK", "0") == "0":
            for line in megatron_fsdp.notices(namespace):
                console.warn(line)
        settings.set_fused_attention(use_flash_attn=bool(getattr(namespace, "use_flash_attn", 0)))
        return original(*args, **kwargs)

    return set_global_variables


def _moe_problems(args: Any) -> list[str]:
    world_size = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    return moe_option_problems(
        num_experts=getattr(args, "num_experts", None),
        topk=getattr(args, "moe_router_topk", 2),
        ep=getattr(args, "expert_model_parallel_size", 1),
        etp=getattr(args, "expert_tensor_parallel_size", None),
        tp=getattr(args, "tensor_model_parallel_size", 1),
        pp=getattr(args, "pipeline_model_parallel_size", 1),
        world_size=world_size,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
    )


def _context_parallel_problems(args: Any) -> list[str]:
    return context_parallel_problems(
        cp=getattr(args, "context_parallel_size", 1) or 1,
        comm_types=comm_types_of(getattr(args, "cp_comm_type", None)),
        hierarchical=getattr(args, "hierarchical_context_parallel_sizes", None),
        transformer_impl=getattr(args, "transformer_impl", "transformer_engine"),
        seq_length=getattr(args, "seq_length", None),
        heads=getattr(args, "num_attention_heads", 1) or 1,
        tp=getattr(args, "tensor_model_parallel_size", 1) or 1,
        window="--window-size" if getattr(args, "window_size", None) is not None else None,
    )


def _validate_args(original: Any) -> Any:
    """Megatron-LM's argument validation, with two changes. First the mixture-of-experts, the
    context-parallel and the activation-recomputation options are checked together
    (:mod:`megatron_npu.moe_options`, :mod:`megatron_npu.context_parallel_options`,
    :mod:`megatron_npu.recompute_options`): a combination that cannot work stops with one
    named line, not Megatron's asserts on every rank. Then Megatron's own
    checks run, less one: it asserts a CUDA compute capability of 8 or more for
    ``--moe-grouped-gemm`` (``torch.cuda.get_device_capability()``), a check of the GPU's
    grouped-GEMM kernels; off CUDA the grouped GEMM is the adaptor's (``npu_grouped_matmul`` on
    the NPU), so the option is hidden from the validation and put back after it."""

    @functools.wraps(original)
    def validate_args(args: Any, defaults: Any = None) -> Any:
        problems = (
            _moe_problems(args) + _context_parallel_problems(args) + recompute_problems_of(args)
        )
        if problems:
            _refuse(MegatronLMOptionConflict(problems))
        grouped = bool(getattr(args, "moe_grouped_gemm", False))
        if grouped:
            args.moe_grouped_gemm = False
        try:
            return original(args, {} if defaults is None else defaults)
        finally:
            if grouped:
                args.moe_grouped_gemm = True

    return validate_args


class MegatronLMCheckpointError(MegatronLMOptionError):
    """A checkpoint Megatron-LM could not load, where it would print why and exit with status 0
    (a run that trained nothing would count as done): one line, exit status 2."""

    header = "Megatron-LM could not load the checkpoint"


def _folder_read(run_args: Any, load_arg: str, *, may_switch: bool) -> tuple[str, Any]:
    """(the option, the folder) Megatron-LM read: ``load_arg``'s, or, where ``load_checkpoint``
    switches to it (``may_switch``: no checkpoint in ``load_arg``'s folder), the
    ``--pretrained-checkpoint`` folder."""
    from megatron.training.checkpointing import checkpoint_exists

    load_dir = getattr(run_args, load_arg, None)
    pretrained = getattr(run_args, "pretrained_checkpoint", None)
    if may_switch and pretrained is not None and not checkpoint_exists(load_dir):
        return "--pretrained-checkpoint", pretrained
    return "--" + load_arg.replace("_", "-"), load_dir


def _missing_checkpoint_exit(load_dir: Any, args: Any) -> bool:
    """Megatron-LM's deliberate exit: ``--exit-on-missing-checkpoint`` and no tracker file (nor
    ``--ckpt-step``) to name an iteration in the folder it read."""
    from megatron.training.checkpointing import checkpoint_exists

    if not getattr(args, "exit_on_missing_checkpoint", False) or getattr(args, "ckpt_step", None):
        return False
    return not checkpoint_exists(load_dir)


def _load_checkpoint(original: Any, *, may_switch: bool = True) -> Any:
    """Megatron-LM's checkpoint load (``load_checkpoint``; ``load_args_from_checkpoint``, which
    ``--use-checkpoint-args`` runs before training, with ``may_switch=False``), with two
    changes. The optimizer classes an ``--optimizer-cpu-offload`` checkpoint records in its
    parameter groups are allowed to torch's ``weights_only`` load
    (:mod:`megatron_npu.optim.recorded_classes`, as the megatron-core common-state entries allow
    them): the legacy ``--ckpt-format torch`` file holds them in the optimizer's state, and
    torch refuses a class. And where the load fails (a legacy file it cannot read, a tracker
    file it cannot parse, a checkpoint without its iteration, an rng state it lacks: a
    ``--no-save-rng`` checkpoint resumed without ``--no-load-rng``), Megatron-LM prints why and
    calls ``sys.exit()`` (status 0, on every rank): that exit becomes one named line and status
    2. Its deliberate exit (``--exit-on-missing-checkpoint``) stays as it is."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        try:
            with also_allowed(recorded_optimizer_classes()):
                return original(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            called = signature.bind(*args, **kwargs)
            called.apply_defaults()
            run_args = called.arguments.get("args")
            if run_args is None:
                from megatron.training.global_vars import get_args

                run_args = get_args()
            option, folder = _folder_read(
                run_args, called.arguments["load_arg"], may_switch=may_switch
            )
            if _missing_checkpoint_exit(folder, run_args):
                raise
            _refuse(
                MegatronLMCheckpointError(
                    [
                        f"{option} {folder}: the reason is printed above; Megatron-LM would "
                        "exit with status 0 having trained nothing"
                    ]
                ),
                every_rank=False,
            )

    return load


def _load_args_from_checkpoint(original: Any) -> Any:
    return _load_checkpoint(original, may_switch=False)


PATCHES = [
    Patch(
        id="megatron-lm.fused-kernels-load",
        target="megatron.legacy.fused_kernels.load",
        replacement=load_fused_kernels,
        requires="megatron.legacy.fused_kernels",
        # Megatron-LM core_v0.17+ has no megatron.legacy and builds no kernels at start-up
        versions="<0.17",
        reason="initialize_megatron builds CUDA kernels with nvcc: nothing to build, the "
        "adaptor's ops serve the fused paths",
        parity_exempt="a build step, no numerics: the ops it stands for have parity cases",
        exempt_test=CLIENT_TEST,
        benchmark_exempt="a build step run once, not a per-step cost",
    ),
    Patch(
        id="megatron-lm.jit-warmup-rng",
        target="megatron.training.initialize._warmup_jit_function",
        replacement=_warmup_in_forked_rng,
        kind="wrap",
        requires="megatron.training.initialize",
        reason="the jit warm-up's scratch draws leave the shared host/device generator untouched, "
        "so host-initialised weights do not depend on the TP size",
        parity_exempt="RNG bookkeeping around scratch tensors, no numerics of its own",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_tp1_and_tp2_runs_agree_by_the_layout_rule",
        benchmark_exempt="runs once at start-up",
    ),
    Patch(
        id="megatron-lm.arguments",
        target="megatron.training.global_vars.set_global_variables",
        replacement=_set_global_variables,
        kind="wrap",
        requires="megatron.training.global_vars",
        reason="--use-flash-attn routes to the fused-attention op; options the adaptor cannot "
        "serve end in one named error (exit 2)",
        parity_exempt="argument plumbing: the attention it routes to has its own parity case",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_flash_attn_routes_to_the_npu_kernel",
        benchmark_exempt="runs once at start-up",
    ),
    Patch(
        id="megatron-lm.validate-args",
        target="megatron.training.arguments.validate_args",
        replacement=_validate_args,
        kind="wrap",
        requires="megatron.training.arguments",
        reason="MoE options that cannot work together end in one named error (exit 2); "
        "--moe-grouped-gemm passes Megatron-LM's CUDA compute-capability check: the adaptor "
        "serves the grouped GEMM",
        parity_exempt="argument validation: the grouped GEMM has its own parity case",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::test_moe_trains[te-grouped-gemm]",
        benchmark_exempt="runs once at start-up",
    ),
    Patch(
        id="megatron-lm.load-checkpoint",
        target="megatron.training.checkpointing.load_checkpoint",
        replacement=_load_checkpoint,
        kind="wrap",
        requires="megatron.training.checkpointing",
        reason="--optimizer-cpu-offload's optimizer classes in a --ckpt-format torch checkpoint "
        "are refused by torch's weights_only load; a failed load exits with status 0 having "
        "trained nothing: one named error (exit 2)",
        parity_exempt="checkpoint plumbing, no numerics of its own",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::"
        "test_legacy_checkpoint_of_an_offloaded_optimizer_resumes_bitwise",
        benchmark_exempt="runs once per checkpoint load",
    ),
    Patch(
        id="megatron-lm.load-checkpoint-args",
        target="megatron.training.checkpointing.load_args_from_checkpoint",
        replacement=_load_args_from_checkpoint,
        kind="wrap",
        requires="megatron.training.checkpointing",
        reason="--use-checkpoint-args reads the checkpoint before training: the same class "
        "allowance and one named error (exit 2) where it would exit with status 0",
        parity_exempt="checkpoint plumbing, no numerics of its own",
        exempt_test="tests/megatron_lm/test_pretrain_gpt.py::"
        "test_legacy_checkpoint_of_an_offloaded_optimizer_resumes_bitwise",
        benchmark_exempt="runs once per checkpoint load",
    ),
]
