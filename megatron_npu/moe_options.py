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


def moe_layer_pattern(freq: int | str | list[int], num_layers: int) -> list[int]:
    """Which layers are MoE layers (1) and which dense (0), from Megatron-LM's
    ``--moe-layer-freq``: an integer N makes every N-th layer an MoE layer, starting with the
    first (Megatron's ``i % N == 0``); a list expression such as ``"([1]*3+[0]*1)*2"`` (lists of
    0 and 1, ``+``, ``*``, parentheses) gives the pattern itself, one entry per layer. Raises
    ValueError naming what is wrong."""
    option = f"--moe-layer-freq {freq}"
    if isinstance(freq, str):
        freq = _pattern_expression(freq.strip(), option)
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"{option}: must be at least 1")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    pattern = list(freq)
    if any(v not in (0, 1) for v in pattern):
        raise ValueError(f"{option}: a pattern holds 0 (dense) and 1 (MoE) only")
    if len(pattern) != num_layers:
        raise ValueError(
            f"{option}: the pattern has {len(pattern)} entries for --num-layers {num_layers}"
        )
    return pattern


def _pattern_expression(text: str, option: str) -> int | list[int]:
    """Evaluate an integer or a list expression of integer lists joined by + and *."""
    import ast

    def value(node: ast.AST) -> int | list[int]:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            if not all(isinstance(i, int) for i in items):
                raise ValueError(f"{option}: a list holds integers only")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                return left * right
        raise ValueError(f"{option}: not an integer or a list expression such as '([1]*3+[0]*1)*2'")

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"{option}: not an integer or a list expression") from None
    return value(tree.body)
