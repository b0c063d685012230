"""``megatron-npu train``: GPT pretraining built from Megatron-Core's own pieces.

One module per job:

* :mod:`.arguments` -- the command line (Megatron's own option names) and its validation
* :mod:`.launch` -- ``--nproc-per-node``: starting and watching the ranks; process-group set-up
* :mod:`.warm_imports` -- what a rank imports, imported once for ranks forked warm
* :mod:`.errors` -- the named errors: bad input (exit 2), a run stopped for training nothing
  (exit 3), each reported once
* :mod:`.children` -- every process a rank forks or spawns dies with it (parent-death signal)
* :mod:`.preflight` -- port, data, ``--save`` and ``--load`` checks before any rank starts
* :mod:`.run_lock` -- one live run per ``--metrics-out`` file and ``--save`` directory
* :mod:`.divergence` -- the rules that stop a run whose loss is NaN/inf, whose steps are all
  skipped or whose learning rate is 0
* :mod:`.security` -- umask 027, the root warning, 0640/0750 modes on what training writes
* :mod:`.model` -- TransformerConfig, the seeded local layer spec, GPTModel chunks, DDP wrapping
* :mod:`.data` -- mock / indexed / default-corpus datasets and the per-DP-rank batch sampler
* :mod:`.optimizer` -- Megatron's optimizer and ``OptimizerParamScheduler``
* :mod:`.loop` -- forward step, train step, the training loop
* :mod:`.metrics` -- per-step records, the ``--metrics-out`` JSON, console and progress display
* :mod:`.checkpointing` -- ``megatron.core.dist_checkpointing`` save/load (reshardable)
* :mod:`.checkpoint_store` -- checkpoints on disk: crash-safe commit, manifest, verification
* :mod:`.safe_load` -- ``--load`` without unpickling code
* :mod:`.schedule` -- the LR/WD schedule a command line asks for

``megatron_npu.train`` is the entry point (``python -m megatron_npu.train`` or torchrun).
"""

import warnings

#: Megatron's CUDA-only notes (apex/TransformerEngine fall-backs, CUDA_DEVICE_MAX_CONNECTIONS):
#: expected off CUDA and printed by every rank; fused NPU ops come in through the registry.
EXPECTED_WARNINGS = (
    r".*Transformer Engine and Apex are not installed.*",
    r"Apex is not installed.*",
    r"full scope is deprecated.*",
    (
        r"When using .* it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS.*"
    ),
)

#: torch 2.13 deprecates the collective names megatron-core 0.16 calls (once per rank and call
#: site); nothing a training run can act on.
EXPECTED_FUTURE_WARNINGS = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*",
)


def quiet_expected_warnings() -> None:
    """Silence :data:`EXPECTED_WARNINGS` in this process (train's entry points call it)."""
    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    for pattern in EXPECTED_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
