"""What each rank of the context-parallel op tests runs (spawned by ``test_context_parallel.py``).

Every rank builds the same full-sequence inputs, takes Megatron's load-balanced rows of its CP
rank, runs the context-parallel attention forward and backward, and reports, per case, the
largest error of its output and its q/k/v gradients against a float64 reference over the whole
sequence (written here from the definition of softmax attention), and the same errors of the
device's single-device fused attention on the same inputs as the yardstick for 16-bit dtypes.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from megatron_npu.ops.context_parallel import local_rows


def reference(q, k, v, *, causal: bool, scale: float, window: int | None) -> torch.Tensor:
    """Softmax attention in float64 over ``[S, b, n, d]`` q and ``[S, b, ng, d]`` k/v."""
    n, ng = q.shape[2], k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3).double() for t in (q, k, v))
    kb, vb = kb.repeat_interleave(n // ng, 1), vb.repeat_interleave(n // ng, 1)
    scores = qb @ kb.transpose(-1, -2) * scale
    size = scores.shape[-1]
    hidden = torch.zeros(size, size, dtype=torch.bool)
    if causal:
        hidden |= torch.ones(size, size, dtype=torch.bool).triu(1)
    if window is not None:
        hidden |= torch.ones(size, size, dtype=torch.bool).tril(-window - 1)
    out = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ vb
    return out.permute(2, 0, 1, 3).flatten(2)


def _inputs(case: dict[str, Any], cp: int):
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    s, b, n, ng, d = 8 * cp, 2, case.get("heads", 4), case.get("kv_heads", 2), 8

    def draw(*shape):
        return torch.randn(*shape, generator=gen)

    return draw(s, b, n, d), draw(s, b, ng, d), draw(s, b, ng, d), draw(s, b, n * d)


_HIERARCHICAL: dict[tuple[int, ...], list] = {}


def hierarchical_groups(sizes: tuple[int, int]) -> list:
    """This rank's pair of groups as Megatron's ``create_hierarchical_groups`` builds them for
    ``--hierarchical-context-parallel-sizes A P`` over the whole world: ``A`` consecutive ranks,
    and ``P`` ranks ``A`` apart (every rank creates every group, in the same order)."""
    if sizes not in _HIERARCHICAL:
        inner, outer = sizes
        rank, mine = dist.get_rank(), []
        for ranks in (
            [list(range(j * inner, (j + 1) * inner)) for j in range(outer)],
            [list(range(i, inner * outer, inner)) for i in range(inner)],
        ):
            for members in ranks:
                group = dist.new_group(members)
                if rank in members:
                    mine.append(group)
        _HIERARCHICAL[sizes] = mine
    return _HIERARCHICAL[sizes]


def _run_cp(case, q, k, v, dout, cp, rank):
    from megatron_npu.ops.context_parallel import context_parallel_attention

    dtype = getattr(torch, case["dtype"])
    window = case.get("window")
    leaves = [local_rows(t, cp, rank).to(dtype).requires_grad_() for t in (q, k, v)]
    group = dist.group.WORLD
    if case["comm"] == "a2a+p2p":
        group = hierarchical_groups(tuple(case["sizes"]))
    out = context_parallel_attention(
        *leaves,
        group,
        comm_type=case["comm"],
        causal=case["causal"],
        **({} if window is None else {"pre_tokens": window, "next_tokens": 0}),
    )
    out.backward(local_rows(dout, cp, rank).to(dtype))
    return out, [t.grad for t in leaves]


def _run_single(case, q, k, v, dout):
    """The device's own fused attention on one rank (the 16-bit yardstick)."""
    from megatron_npu.ops.attention import fused_attention

    dtype = getattr(torch, case["dtype"])
    window = case.get("window")
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fused_attention(
        *(t.flatten(2) for t in leaves),
        head_num=q.shape[2],
        input_layout="SBH",
        causal=case["causal"],
        **({} if window is None else {"pre_tokens": window, "next_tokens": 0}),
    )
    out.backward(dout.to(dtype))
    return out, [t.grad for t in leaves]


def _errors(got, grads, want, want_grads, select) -> list[float]:
    pairs = [(got, select(want))] + [(g, select(w)) for g, w in zip(grads, want_grads, strict=True)]
    return [float((a.double() - b).abs().max()) for a, b in pairs]


def check_case(case: dict[str, Any], cp: int, rank: int) -> dict[str, Any]:
    from megatron_npu.testing.torch_npu_emulation import count_kernel_calls

    q, k, v, dout = _inputs(case, cp)
    scale = q.shape[3] ** -0.5
    full = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference(*full, causal=case["causal"], scale=scale, window=case.get("window"))
    want.backward(dout.double())
    with count_kernel_calls() as calls:
        out, grads = _run_cp(case, q, k, v, dout, cp, rank)
    result = {
        "errors": _errors(
            out, grads, want, [t.grad for t in full], lambda x: local_rows(x, cp, rank)
        ),
        "kernels": dict(calls),
    }
    if case["dtype"] != "float32":
        single, single_grads = _run_single(case, q, k, v, dout)
        result["single"] = _errors(single, single_grads, want, [t.grad for t in full], lambda x: x)
    return result


def dropout_gradient_check(case: dict[str, Any], cp: int, rank: int) -> dict[str, float]:
    """With attention dropout, the backward must be the derivative of the forward that ran:
    the directional derivative ``<grad, dir>`` of ``sum(out * dout)`` against a central
    difference, the RNG re-seeded before every forward so each draws the same masks."""
    from megatron_npu.ops.context_parallel import context_parallel_attention

    dtype = getattr(torch, case["dtype"])
    q, k, v, dout = _inputs(case, cp)
    q, k, v, dout = (local_rows(t, cp, rank).to(dtype) for t in (q, k, v, dout))
    gen = torch.Generator().manual_seed(7)
    directions = [torch.randn(t.shape, generator=gen).to(dtype) for t in (q, k, v)]

    def loss(tensors):
        torch.manual_seed(1234)
        out = context_parallel_attention(
            *tensors, dist.group.WORLD, comm_type=case["comm"], causal=case["causal"], dropout_p=0.3
        )
        return (out.double() * dout.double()).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    value = loss(leaves)
    value.backward()
    analytic = sum(
        float((t.grad.double() * d.double()).sum()) for t, d in zip(leaves, directions, strict=True)
    )
    eps = case["eps"]
    plus = loss([t + eps * d for t, d in zip((q, k, v), directions, strict=True)])
    minus = loss([t - eps * d for t, d in zip((q, k, v), directions, strict=True)])
    no_dropout = context_parallel_attention(
        q, k, v, dist.group.WORLD, comm_type=case["comm"], causal=case["causal"]
    )
    torch.manual_seed(1234)
    again = context_parallel_attention(
        q, k, v, dist.group.WORLD, comm_type=case["comm"], causal=case["causal"], dropout_p=0.3
    )
    torch.manual_seed(1234)
    first = context_parallel_attention(
        q, k, v, dist.group.WORLD, comm_type=case["comm"], causal=case["causal"], dropout_p=0.3
    )
    # every rank's share of the loss: the difference quotient is over the whole objective
    totals = torch.tensor([analytic, float(plus - minus) / (2 * eps)], dtype=torch.float64)
    dist.all_reduce(totals)
    return {
        "analytic": float(totals[0]),
        "numeric": float(totals[1]),
        "repeatable": bool(torch.equal(again, first)),
        "dropped": float((first - no_dropout).abs().max()),
    }


def half_dropout_check(case: dict[str, Any], cp: int, rank: int) -> dict[str, Any]:
    """16-bit attention dropout: the masks follow from the seed and the shapes, not the dtype,
    so a 16-bit run and an fp32 run of the same inputs (values the 16-bit dtype holds),
    re-seeded alike, drop the same scores. The 16-bit output and q/k/v gradients must then be as
    close to the fp32 run's as they are without dropout (the fp32 ring's dropout backward is
    the derivative of its forward, :func:`dropout_gradient_check`, and without dropout it is
    whole-sequence attention, :func:`check_case`): a 16-bit path that drew, scaled or replayed
    its masks differently would be off by the dropped scores themselves."""
    from megatron_npu.ops.context_parallel import context_parallel_attention

    half = getattr(torch, case["dtype"])
    q, k, v, dout = _inputs(case, cp)
    q, k, v, dout = (local_rows(t, cp, rank).to(half).float() for t in (q, k, v, dout))

    def run(dtype: torch.dtype, dropout_p: float) -> list[torch.Tensor]:
        torch.manual_seed(1234)
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(
            *leaves,
            dist.group.WORLD,
            comm_type=case["comm"],
            causal=case["causal"],
            dropout_p=dropout_p,
        )
        out.backward(dout.to(dtype))
        return [out, *(t.grad for t in leaves)]

    def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
        return [
            float((a.double() - b.double()).abs().max()) for a, b in zip(got, want, strict=True)
        ]

    dropped, dropped_fp32 = run(half, 0.3), run(torch.float32, 0.3)
    plain, plain_fp32 = run(half, 0.0), run(torch.float32, 0.0)
    return {
        "errors": errors(dropped, dropped_fp32),
        "yardstick": errors(plain, plain_fp32),
        "dropped": float((dropped_fp32[0] - plain_fp32[0]).abs().max()),
    }


CHECKS = {"dropout": dropout_gradient_check, "dropout16": half_dropout_check}


def worker(rank: int, world: int, store: str, device: str, jobs: list, results: Any) -> None:
    """Join a gloo group of ``world`` ranks, apply the adaptor for ``device``, run ``jobs``
    (``(kind, case)``) and put ``(rank, index, outcome)`` on ``results``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import megatron_npu

    megatron_npu.apply(device)
    try:
        for index, (kind, case) in enumerate(jobs):
            try:
                check = CHECKS.get(kind, check_case)
                results.put((rank, index, check(case, world, rank)))
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                results.put((rank, index, {"raised": traceback.format_exc()}))
    finally:
        megatron_npu.restore()
        dist.barrier()
        dist.destroy_process_group()
