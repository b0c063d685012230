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
    window: str | None,
    hierarchical: Sequence[int] | None = None,
) -> list[str]:
    """Each broken combination as ``"--option ...: why"`` (empty when CP is 1 or the options
    agree). ``window``: the option that asks for a sliding window, as the user wrote it
    (``--window-size`` for Megatron-LM, ``--pre-tokens N`` for ``megatron-npu train``), or None;
    ``hierarchical``: ``--hierarchical-context-parallel-sizes`` (a2a+p2p)."""
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
        elif kind in ("p2p", "a2a+p2p") and window:
            problems.append(
                f"--cp-comm-type {kind} with {window}: the ring serves causal and full "
                "attention; use --cp-comm-type a2a or allgather for a sliding window"
            )
        if kind == "a2a+p2p":
            sizes = list(hierarchical or ())
            if len(sizes) != 2 or sizes[0] * sizes[1] != cp:
                problems.append(
                    f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P "
                    f"(all-to-all within A ranks, a ring over P) with A x P = "
                    f"--context-parallel-size {cp}; got {sizes or 'none'}"
                )
            elif (heads // max(tp, 1)) % sizes[0]:
                problems.append(
                    f"--cp-comm-type a2a+p2p: the {heads // max(tp, 1)} attention heads per "
                    f"tensor-parallel rank are shared out over the {sizes[0]} ranks of the "
                    f"all-to-all, so {sizes[0]} must divide them"
                )
    return problems
