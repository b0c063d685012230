"""The context-parallel options that cannot work, as one list of named problems.

Megatron checks some of these late and by ``assert`` (the sequence length in ``validate_args``,
the local spec's ``DotProductAttention`` at model build, a head count that an all-to-all cannot
split only inside the attention), so a bad combination ends in a traceback per rank. The adaptor
checks them before Megatron does and stops with one line naming the options.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_npu.ops.context_parallel import COMM_TYPES, REFUSED_COMM_TYPES


def comm_types_of(value: str | Sequence[str] | None) -> list[str]:
    """``--cp-comm-type`` as Megatron-LM keeps it: one value, or one per layer."""
    if value is None:
        return ["p2p"]
    return [value] if isinstance(value, str) else list(value)


def context_parallel_problems(
    *,
    cp: int,
    comm_types: Sequence[str],
    transformer_impl: str,
    seq_length: int | None,
    heads: int,
    tp: int,
    window: bool,
) -> list[str]:
    """Each broken combination as ``"--option ...: why"`` (empty when CP is 1 or the options
    agree). ``window``: the run asks for a sliding window (``--window-size``)."""
    if cp <= 1:
        return []
    problems = []
    if transformer_impl != "transformer_engine":
        problems.append(
            f"--context-parallel-size {cp} with --transformer-impl {transformer_impl}: context "
            "parallelism runs through TE's attention (Megatron's local DotProductAttention "
            "serves one context-parallel rank); use --transformer-impl transformer_engine"
        )
    if seq_length is not None and seq_length % (2 * cp):
        problems.append(
            f"--seq-length {seq_length}: each of the {cp} context-parallel ranks holds two "
            f"load-balanced chunks, so it must be a multiple of 2 x {cp} = {2 * cp}"
        )
    for kind in dict.fromkeys(comm_types):
        if kind in REFUSED_COMM_TYPES:
            problems.append(f"--cp-comm-type {kind}: {REFUSED_COMM_TYPES[kind]}")
        elif kind not in COMM_TYPES:
            problems.append(f"--cp-comm-type {kind}: unknown; served: {', '.join(COMM_TYPES)}")
        elif kind == "a2a" and (heads // max(tp, 1)) % cp:
            problems.append(
                f"--cp-comm-type a2a: the {heads // max(tp, 1)} attention heads per "
                f"tensor-parallel rank are shared out over {cp} context-parallel ranks, so "
                f"--context-parallel-size {cp} must divide them"
            )
        elif kind == "p2p" and window:
            problems.append(
                "--cp-comm-type p2p with --window-size: the ring serves causal and full "
                "attention; use --cp-comm-type a2a or allgather for a sliding window"
            )
    return problems
