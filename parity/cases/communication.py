"""Parity of Megatron's communication modules under the adaptor's ``torch`` namespace routing.

The ``torch-namespace:*`` patches send ``torch.cuda.current_device()``, ``torch.cuda.synchronize``
and ``device="cuda"`` in these modules to the active device. Both cases run Megatron's own
functions on real gloo groups and check that the right data arrives.

``P2P`` (PP2): one 1F1B exchange of two microbatches between the two pipeline stages through
``P2PCommunicator`` (megatron-core 0.16's API): warm-up ``send_forward`` / ``recv_forward``,
steady state ``send_forward_recv_backward`` against ``send_backward_recv_forward``, cool-down
``recv_backward`` / ``send_backward``; batched (``batch_isend_irecv``) and unbatched ops, fixed
and variable sequence lengths (the shape exchange that allocates on ``torch.cuda``). Received
tensors are compared *bit-exactly* (integer views) with what the other stage sent.

``TP_MAPPINGS`` (TP2, TP4): forward and backward of the tensor- and sequence-parallel region
functions against plain torch on the full tensors. Every rank's result is brought to rank 0 with
a plain ``all_gather`` (not the code under test) and stacked, so a wrong rank is visible. The
inputs lie on a coarse grid (multiples of 1/8 up to 8 in size) on which every partial sum of up
to four of them is exact even in bf16, so the reductions have no rounding error in any dtype and
the results are compared bit-exactly too: a 16-bit all-reduce of arbitrary values rounds after
each addition (on gloo as on NCCL/HCCL), which measures the collective's arithmetic, not whether
the adaptor moved the right data.
"""

from __future__ import annotations

from hypothesis import strategies as st
from megatron_npu.parity.case import Context, Parallel, ParityCase
from megatron_npu.parity.cases._common import bits, gather, generator

# ============================================================================ P2P


def _p2p_params():
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 16),
            "batch": st.integers(1, 2),
            "hidden": st.integers(1, 32),
            "batched": st.booleans(),
            "variable_seq_lengths": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


def _p2p_inputs(p):
    import torch

    g = generator(p)
    shape = (p["seq"], p["batch"], p["hidden"])
    return {
        name: torch.randn(*shape, generator=g, dtype=torch.float64) * 100
        for name in ("act0", "act1", "grad0", "grad1")
    }


_P2P_CALLS = (
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
)


def _p2p_communicator(group, config):
    """Megatron's ``P2PCommunicator`` (0.14+), or on 0.13 its module-level functions, which take
    the config and use parallel_state's pipeline group (the same group here)."""
    import functools
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import p2p_communication as p2p

    if hasattr(p2p, "P2PCommunicator"):
        return p2p.P2PCommunicator(pp_group=group, config=config)
    return SimpleNamespace(
        **{name: functools.partial(getattr(p2p, name), config=config) for name in _P2P_CALLS}
    )


def _p2p_run(ctx: Context, inputs):
    import torch
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    p = ctx.params
    group = parallel_state.get_pipeline_model_parallel_group()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2,
        pipeline_dtype=ctx.dtype,
        batch_p2p_comm=p["batched"],
        variable_seq_lengths=p["variable_seq_lengths"],
    )
    comm = _p2p_communicator(group, config)
    shape = (p["seq"], p["batch"], p["hidden"])
    zeros = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
    if parallel_state.is_pipeline_first_stage():
        comm.send_forward(ctx.tensor(inputs["act0"]), is_last_stage=False)
        grad0 = comm.send_forward_recv_backward(
            ctx.tensor(inputs["act1"]), shape, is_last_stage=False
        )
        grad1 = comm.recv_backward(shape, is_last_stage=False)
        recv = {"act0": zeros, "act1": zeros, "grad0": grad0, "grad1": grad1}
    else:
        act0 = comm.recv_forward(shape, is_first_stage=False)
        act1 = comm.send_backward_recv_forward(
            ctx.tensor(inputs["grad0"]), shape, is_first_stage=False
        )
        comm.send_backward(ctx.tensor(inputs["grad1"]), is_first_stage=False)
        recv = {"act0": act0, "act1": act1, "grad0": zeros, "grad1": zeros}
    out = {}
    for name, tensor in recv.items():
        both = gather(tensor, group)  # [stage 0's copy, stage 1's copy]
        receiver = 1 if name.startswith("act") else 0
        out[f"received_{name}"] = bits(both[receiver], ctx.tested_dtype)
    return out


def _p2p_reference(ctx: Context, inputs):
    return {
        f"received_{name}": bits(ctx.tensor(inputs[name]), ctx.tested_dtype)
        for name in ("act0", "act1", "grad0", "grad1")
    }


P2P = ParityCase(
    name="p2p",
    params=_p2p_params(),
    make_inputs=_p2p_inputs,
    run=_p2p_run,
    reference=_p2p_reference,
    compares="activations received by stage 1 and gradients received by stage 0 in a 1F1B "
    "exchange, bit-exactly against what was sent",
    reference_kind="the sent tensors themselves (bit patterns in the tested dtype)",
    parallel=(Parallel(pp=2),),
    edge_cases=(
        dict(seq=8, batch=2, hidden=16, batched=True, variable_seq_lengths=False, seed=1),
        dict(seq=5, batch=1, hidden=3, batched=False, variable_seq_lengths=True, seed=2),
        dict(seq=1, batch=1, hidden=1, batched=True, variable_seq_lengths=True, seed=3),
    ),
)


# ============================================================================ TP mappings

_MAX_TP = 4
_OPS = ("copy", "reduce", "scatter", "gather", "sp_scatter", "sp_gather", "sp_reduce_scatter")


def _tp_params():
    return st.fixed_dictionaries(
        {
            "seq": st.integers(1, 4).map(lambda s: s * _MAX_TP),
            "batch": st.integers(1, 2),
            "hidden": st.integers(1, 8).map(lambda h: h * _MAX_TP),
            "seed": st.integers(0, 2**16),
        }
    )


def _tp_inputs(p):
    import torch

    g = generator(p)
    s, b, h = p["seq"], p["batch"], p["hidden"]

    def randn(*shape):  # k / 8 with |k| <= 64: sums of up to 4 are exact in bf16
        return torch.randint(-64, 65, shape, generator=g).to(torch.float64) / 8

    out = {"x": randn(s, b, h), "g_full": randn(s, b, h)}
    for r in range(_MAX_TP):
        out[f"x{r}"] = randn(s, b, h)  # a per-rank full-size tensor (partial sums)
        out[f"g{r}"] = randn(s, b, h)  # a per-rank upstream grad of a full-size output
    return out


def _tp_run(ctx: Context, inputs):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings as m

    group = parallel_state.get_tensor_model_parallel_group()
    tp, r = group.size(), group.rank()

    def leaf(name, chunks=None, dim=None):
        t = ctx.tensor(inputs[name])
        if chunks is not None:
            t = t.chunk(chunks, dim=dim)[r]
        return t.detach().clone().requires_grad_(True)

    def upstream(name, dim=None):
        g = ctx.tensor(inputs[name])
        return g if dim is None else g.chunk(tp, dim=dim)[r]

    out = {}

    def record(op, y, x, g):
        y.backward(g.to(y.dtype))
        out[f"{op}.out"] = bits(gather(y, group), ctx.tested_dtype)
        out[f"{op}.grad"] = bits(gather(x.grad, group), ctx.tested_dtype)

    x = leaf("x")  # fwd identity, bwd all-reduce of every rank's grad
    record("copy", m.copy_to_tensor_model_parallel_region(x), x, upstream(f"g{r}"))
    x = leaf(f"x{r}")  # fwd all-reduce, bwd identity (the output is replicated)
    record("reduce", m.reduce_from_tensor_model_parallel_region(x), x, upstream("g_full"))
    x = leaf("x")  # fwd keep this rank's last-dim chunk, bwd all-gather
    record("scatter", m.scatter_to_tensor_model_parallel_region(x), x, upstream("g_full", -1))
    x = leaf("x", tp, -1)  # fwd all-gather the last dim, bwd keep this rank's chunk
    record("gather", m.gather_from_tensor_model_parallel_region(x), x, upstream("g_full"))
    x = leaf("x")  # fwd keep this rank's sequence chunk, bwd all-gather the sequence
    record("sp_scatter", m.scatter_to_sequence_parallel_region(x), x, upstream("g_full", 0))
    x = leaf("x", tp, 0)  # fwd all-gather the sequence, bwd reduce-scatter
    record("sp_gather", m.gather_from_sequence_parallel_region(x), x, upstream(f"g{r}"))
    x = leaf(f"x{r}")  # fwd reduce-scatter the sequence, bwd all-gather
    record(
        "sp_reduce_scatter",
        m.reduce_scatter_to_sequence_parallel_region(x),
        x,
        upstream("g_full", 0),
    )
    return out


def _tp_reference(ctx: Context, inputs):
    import torch

    tp = ctx.parallel.tp
    t = {name: ctx.tensor(v) for name, v in inputs.items()}
    x, g_full = t["x"], t["g_full"]
    xs = [t[f"x{r}"] for r in range(tp)]
    gs = [t[f"g{r}"] for r in range(tp)]
    total, g_total = sum(xs), sum(gs)

    def same(v):  # the same tensor on every rank
        return torch.stack([v] * tp)

    def per(vs):
        return torch.stack(list(vs))

    want = {
        "copy.out": same(x),
        "copy.grad": same(g_total),
        "reduce.out": same(total),
        "reduce.grad": same(g_full),
        "scatter.out": per(x.chunk(tp, dim=-1)),
        "scatter.grad": same(g_full),
        "gather.out": same(x),
        "gather.grad": per(g_full.chunk(tp, dim=-1)),
        "sp_scatter.out": per(x.chunk(tp, dim=0)),
        "sp_scatter.grad": same(g_full),
        "sp_gather.out": same(x),
        "sp_gather.grad": per(g_total.chunk(tp, dim=0)),
        "sp_reduce_scatter.out": per(total.chunk(tp, dim=0)),
        "sp_reduce_scatter.grad": same(g_full),
    }
    return {name: bits(v, ctx.tested_dtype) for name, v in want.items()}


TP_MAPPINGS = ParityCase(
    name="tp-mappings",
    params=_tp_params(),
    make_inputs=_tp_inputs,
    run=_tp_run,
    reference=_tp_reference,
    compares="forward output and input grad of copy_to / reduce_from / scatter_to / gather_from "
    "the tensor-model-parallel region and scatter_to / gather_from / reduce_scatter_to the "
    "sequence-parallel region, every rank's result stacked; bit-exact (inputs on an exact grid)",
    reference_kind="plain torch on the full tensors (sums, chunks) on CPU, inputs upcast",
    parallel=(Parallel(tp=2), Parallel(tp=4)),
    edge_cases=(
        {"seq": 8, "batch": 2, "hidden": 16, "seed": 1},
        {"seq": 4, "batch": 1, "hidden": 4, "seed": 2},  # one row / column per rank at TP4
    ),
)
