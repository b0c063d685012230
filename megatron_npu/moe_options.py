"""The mixture-of-experts options that cannot work together, as one list of named problems.

Megatron checks these late and by ``assert`` (in ``validate_args``, ``TransformerConfig`` or
``initialize_model_parallel``, and a top-k above the expert count only inside the router's
``torch.topk`` at the first step), so a bad combination ends in a traceback per rank. The
adaptor checks them before Megatron does and stops with one line naming the options.
"""

from __future__ import annotations


def moe_option_problems(
    *,
    num_experts: int | None,
    topk: int,
    ep: int,
    etp: int | None,
    tp: int,
    pp: int,
    world_size: int,
    sequence_parallel: bool,
) -> list[str]:
    """Each broken combination as ``"--option ...: why"`` (empty when the options agree).
    ``etp`` None means Megatron's default: the expert tensor-parallel size is the TP size."""
    problems = []
    if num_experts is None:
        if ep > 1:
            problems.append(f"--expert-model-parallel-size {ep}: needs --num-experts")
        return problems
    if num_experts < 1:
        problems.append(f"--num-experts {num_experts}: must be at least 1")
        return problems
    if not 1 <= topk <= num_experts:
        problems.append(
            f"--moe-router-topk {topk}: each token picks that many distinct experts, so it must "
            f"be between 1 and --num-experts {num_experts}"
        )
    if num_experts % ep:
        problems.append(
            f"--expert-model-parallel-size {ep}: does not divide --num-experts {num_experts} "
            "(every rank holds the same number of experts)"
        )
    if tp > 1 and not sequence_parallel:
        problems.append(
            f"--num-experts with --tensor-model-parallel-size {tp}: needs --sequence-parallel "
            "(megatron-core's rule for MoE under tensor parallelism)"
        )
    expert_ranks = ep * (tp if etp is None else etp) * pp
    if world_size % expert_ranks:
        problems.append(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
            f"{tp if etp is None else etp} x --pipeline-model-parallel-size {pp} = {expert_ranks} "
            f"ranks per expert replica: does not divide the {world_size} ranks"
        )
    return problems
