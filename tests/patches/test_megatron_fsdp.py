"""The Megatron-FSDP entries' parts, each against Megatron's own code or torch's optimizers: the
reduce op without PREMUL_SUM, the optimizer state a checkpoint keeps of every parameter, and the
notice for tied embeddings. The two-rank training and resume run is in
``tests/megatron_lm/test_pretrain_gpt.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_npu.patches import megatron_fsdp


def _megatrons_own():
    """Megatron-FSDP's own ``gradient_reduce_preprocessing``, whatever is installed now."""
    from megatron_npu import patcher
    from megatron_npu.registry import get_patch

    return patcher.original(get_patch("megatron-fsdp.gradient-reduce-op"))


def _skip_without_megatron_fsdp(patch_id: str):
    """The registry entry ``patch_id``; the test is skipped where it does not apply (megatron-core
    0.13, which has no Megatron-FSDP: its forerunner is refused by name)."""
    from megatron_npu.patcher import megatron_core_version
    from megatron_npu.registry import get_patch

    patch = get_patch(patch_id)
    if not patch.applies_to_version(megatron_core_version()):
        pytest.skip("megatron-core 0.13 has no Megatron-FSDP (its forerunner is refused)")
    return patch


def _config(**kw):
    return SimpleNamespace(
        **{"average_in_collective": False, "gradient_reduce_div_fusion": True, **kw}
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reduce_op_is_a_sum_of_scaled_gradients_never_premul_sum(dtype):
    _skip_without_megatron_fsdp("megatron-fsdp.gradient-reduce-op")
    grad = torch.tensor([1.0, -3.0, 0.5], dtype=dtype)
    ours = grad.clone()
    op = megatron_fsdp.gradient_reduce_preprocessing(ours, 0.25, _config())
    assert op == torch.distributed.ReduceOp.SUM
    assert torch.equal(ours, grad * 0.25)
    # Megatron's own choice where it does not ask for PREMUL_SUM: the same op, the same numbers
    theirs = grad.clone()
    own = _megatrons_own()(theirs, 0.25, _config(gradient_reduce_div_fusion=False))
    assert own == op and torch.equal(theirs, ours)
    # no factor: a plain sum; averaging in the collective: the group average, unscaled
    untouched = grad.clone()
    assert megatron_fsdp.gradient_reduce_preprocessing(untouched, None, _config()) == op
    averaged = megatron_fsdp.gradient_reduce_preprocessing(
        untouched, 0.25, _config(average_in_collective=True)
    )
    assert averaged == torch.distributed.ReduceOp.AVG and torch.equal(untouched, grad)


def _precision_aware(groups):
    from megatron_npu.optim.precision_aware import PrecisionAwareAdamW

    return PrecisionAwareAdamW(
        groups, lr=0.1, master_weights=True, exp_avg_dtype=torch.bfloat16, weight_decay=0.1
    )


#: optimizer -> (how it is built over parameter groups, the states it keeps shaped like a
#: parameter): torch's AdamW and Adam (what Megatron builds without TE or apex), and an optimizer
#: whose states are in dtypes of their own (the precision-aware AdamW: bf16 moments, a master)
OPTIMIZERS = {
    "adamw": (lambda groups: torch.optim.AdamW(groups, lr=0.1), {"exp_avg", "exp_avg_sq"}),
    "adam": (lambda groups: torch.optim.Adam(groups, lr=0.1), {"exp_avg", "exp_avg_sq"}),
    "precision-aware": (_precision_aware, {"exp_avg", "exp_avg_sq", "master_param"}),
}


def _with_an_empty_shard(name, dtype=torch.float32):
    """Optimizer ``name`` over three parameters after one step: the middle one is an empty
    shard (no elements here), which never gets a gradient and so no state."""
    params = [
        torch.nn.Parameter(torch.ones(3, dtype=dtype)),
        torch.nn.Parameter(torch.ones(0, dtype=dtype)),
        torch.nn.Parameter(torch.ones(2, 2, dtype=dtype)),
    ]
    optimizer = _build(name, params)
    _step(optimizer, params, 0.5)
    return optimizer, params


def _build(name, params):
    return OPTIMIZERS[name][0]([{"params": params[:2]}, {"params": params[2:]}])


def _step(optimizer, params, scale):
    params[0].grad = torch.full_like(params[0], scale)
    params[2].grad = torch.full_like(params[2], -2 * scale)
    optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_parameter_has_an_entry_in_parameter_order_and_empty_shards_no_scalar(name):
    dtype = torch.bfloat16 if name == "precision-aware" else torch.float32
    optimizer, params = _with_an_empty_shard(name, dtype)
    assert params[1] not in optimizer.state  # it made none: the ranks would part
    entries = megatron_fsdp.every_parameters_state(optimizer)
    assert [p for p, _ in entries] == params
    first, empty, last = (state for _, state in entries)
    assert first is optimizer.state[params[0]] and last is optimizer.state[params[2]]
    assert set(empty) == OPTIMIZERS[name][1]  # no step: the holder's alone counts
    for key, value in empty.items():
        assert value.shape == params[1].shape and value.dtype == first[key].dtype, key
    assert params[1] not in optimizer.state  # the live optimizer is left as it was


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_checkpoint_of_every_parameter_resumes_as_the_optimizer_goes_on(name):
    """The saved entries, loaded into a fresh optimizer of the same kind (the empty shard's given
    the scalars it lacks), make the next step the uninterrupted optimizer's, bitwise."""
    dtype = torch.bfloat16 if name == "precision-aware" else torch.float32
    optimizer, params = _with_an_empty_shard(name, dtype)
    entries = megatron_fsdp.every_parameters_state(optimizer)
    state = {i: {k: v.clone() for k, v in s.items()} for i, (_, s) in enumerate(entries)}
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _build(name, fresh_params)
    megatron_fsdp.give_empty_shards_a_step(state)
    assert set(state[1]) == OPTIMIZERS[name][1] | {"step"}
    assert torch.equal(state[1]["step"], state[0]["step"])
    assert state[1]["step"] is not state[0]["step"]
    saved = optimizer.state_dict()
    fresh.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    _step(optimizer, params, 0.25)
    _step(fresh, fresh_params, 0.25)
    for ours, theirs in zip(fresh_params, params, strict=True):
        assert torch.equal(ours, theirs)


def test_empty_shards_take_the_holders_kinds_in_their_own_dtype_and_nothing_before_a_step():
    """torch's Adam keeps its moments in each parameter's dtype: an empty bf16 shard beside an
    fp32 holder gets bf16 moments. Before the first step no rank holds any state, and no entry
    gets any (every rank's entries then agree)."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0).bfloat16())]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    assert all(state == {} for _, state in megatron_fsdp.every_parameters_state(optimizer))
    params[0].grad = torch.full((3,), 0.5)
    optimizer.step()
    _, empty = megatron_fsdp.every_parameters_state(optimizer)[1]
    assert set(empty) == {"exp_avg", "exp_avg_sq"}
    assert all(t.dtype == torch.bfloat16 and t.numel() == 0 for t in empty.values())


def _tied_fused_megatron_fsdp(**args):
    """Megatron-LM's args for Megatron-FSDP with tied embeddings, gradient-accumulation fusion and
    one pipeline stage, with ``args`` changed."""
    return SimpleNamespace(
        **{
            "use_megatron_fsdp": True,
            "untie_embeddings_and_output_weights": False,
            "gradient_accumulation_fusion": True,
            "pipeline_model_parallel_size": 1,
            **args,
        }
    )


@pytest.mark.parametrize(
    "args, noticed",
    [
        ({}, True),
        ({"untie_embeddings_and_output_weights": True}, False),
        ({"gradient_accumulation_fusion": False}, False),
        ({"pipeline_model_parallel_size": 2}, False),
        ({"use_megatron_fsdp": False}, False),
    ],
)
def test_tied_embeddings_with_fusion_under_megatron_fsdp_get_one_notice(args, noticed):
    namespace = _tied_fused_megatron_fsdp(**args)
    lines = megatron_fsdp.notices(namespace)
    assert len(lines) == noticed
    if noticed:
        assert "--untie-embeddings-and-output-weights" in lines[0]


@pytest.mark.parametrize("version, stops", [("0.15.3", True), ("0.16.1", False), ("0.19.2", False)])
@pytest.mark.parametrize(
    "args, fused_tied",
    [
        ({}, True),
        ({"untie_embeddings_and_output_weights": True}, False),
        ({"gradient_accumulation_fusion": False}, False),
        ({"pipeline_model_parallel_size": 2}, False),
    ],
)
def test_tied_embeddings_with_fusion_are_refused_in_one_line_where_megatron_fsdp_stops(
    monkeypatch, version, stops, args, fused_tied
):
    """megatron-core 0.15's Megatron-FSDP stops in the tied output layer's fused weight-gradient
    backward: that combination alone is refused, by name, with the options that train."""
    from megatron_npu import patcher

    monkeypatch.setattr(patcher, "megatron_core_version", lambda: version)
    namespace = _tied_fused_megatron_fsdp(**args)
    lines = megatron_fsdp.problems(namespace)
    assert len(lines) == (stops and fused_tied), lines
    if lines:
        assert lines[0].startswith(f"--use-megatron-fsdp: megatron-core {version}'s")
        assert "--untie-embeddings-and-output-weights" in lines[0]
        assert "--no-gradient-accumulation-fusion" in lines[0]


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")
def test_coalesced_gathers_on_a_host_device_are_complete_when_the_block_ends(cpu_adaptor):
    """Megatron-FSDP's parameter gathers (a coalesced all-gather it asks to be asynchronous) are
    done when the block ends on cpu: the manager holds no work left to wait for, and the
    buckets hold the gathered weights."""
    import importlib

    import torch.distributed as dist
    from megatron_npu.parity.cases._common import megatron_parallel

    patch = _skip_without_megatron_fsdp("megatron-fsdp.synchronous-gathers")
    buffers = importlib.import_module(patch.target.rpartition(".")[0])
    with megatron_parallel():
        shard = torch.arange(4.0)
        bucket = torch.empty(4 * dist.get_world_size())
        with buffers._coalescing_manager(dist.group.WORLD, async_ops=True) as gathered:
            dist.all_gather_into_tensor(bucket, shard)
        assert gathered.works == []  # nothing in flight: waited at the block's end
        assert torch.equal(bucket, shard.repeat(dist.get_world_size()))


class _GradBuffer:
    """What megatron-core 0.15's ``_bucket_group_gradient_reduce`` reads of a sharded gradient
    buffer: its own shard (``data``), the full bucket it reduces (``fetch_bucket``), its
    factor, dtype and config."""

    def __init__(self, bucket: torch.Tensor, shard: torch.Tensor, factor: float, **config):
        self.bucket = SimpleNamespace(data=bucket)
        self.data = shard
        self.dtype = bucket.dtype
        self.gradient_scaling_factor = factor
        self.ddp_config = _config(**config)

    def fetch_bucket(self):
        return self.bucket


def _megatron_core_0_15_up_to_the_collective(sent: list):
    """0.15's ``_bucket_group_gradient_reduce`` of one bucket on one rank, up to the collective:
    the preprocessing is handed the rank's shard (``gbuf.data``), and the op it returns and the
    bucket as it then is go to the collective (``sent``)."""

    def reduce(pipeline, bucket_group, async_op=False, outer_fsdp_group_grad_reduce=False):
        gbuf = pipeline.get_fsdp_buffer(bucket_group[0])
        op = megatron_fsdp.gradient_reduce_preprocessing(
            gbuf.data, gbuf.gradient_scaling_factor, gbuf.ddp_config
        )
        sent.append((op, gbuf.fetch_bucket().data.clone()))

    return reduce


@pytest.mark.parametrize(
    "dtype, config, averaged",
    [
        (torch.float32, {}, True),  # PREMUL_SUM on a GPU: the average
        (torch.bfloat16, {}, False),  # Megatron scales its shard on a GPU too
        (torch.float32, {"gradient_reduce_div_fusion": False}, False),
    ],
)
def test_megatron_core_0_15_averages_the_buckets_premul_sum_would(dtype, config, averaged):
    """Two ranks' gradients through megatron-core 0.15's reduce arithmetic with the adaptor's
    wrap, then reduce-scattered as a sum into each rank's shard: where NCCL's PREMUL_SUM would
    scale inside the collective, each shard ends as its part of the ranks' average (the
    distributed optimizer's gradient); where Megatron scales before the collective, its own
    arithmetic (the shard scaled, the buckets summed) is left as it is. Each shard starts from
    an earlier micro-batch's reduced part, which only Megatron's own scaling touches. Each
    buffer's factor is its own again after the call."""
    grads = [torch.tensor([1.0, -2.0, 3.0, 4.0]), torch.tensor([3.0, 2.0, -1.0, 0.5])]
    earlier = [torch.tensor([0.25, -1.0]), torch.tensor([2.0, 0.75])]
    buffers = [
        _GradBuffer(g.to(dtype, copy=True), e.to(dtype, copy=True), 0.5, **config)
        for g, e in zip(grads, earlier, strict=True)
    ]
    sent: list = []
    wrapped = megatron_fsdp._wrap_bucket_group_reduce(
        _megatron_core_0_15_up_to_the_collective(sent)
    )
    for gbuf in buffers:
        wrapped(SimpleNamespace(get_fsdp_buffer=lambda _id, b=gbuf: b), [0])
    assert {op for op, _ in sent} == {torch.distributed.ReduceOp.SUM}
    total = sum(bucket for _, bucket in sent)
    for rank, gbuf in enumerate(buffers):
        gbuf.data += total.chunk(len(buffers))[rank]
    expected = (
        torch.cat(earlier) + (grads[0] + grads[1]) * 0.5
        if averaged
        else torch.cat(earlier) * 0.5 + grads[0] + grads[1]
    )
    assert torch.equal(torch.cat([b.data for b in buffers]).float(), expected)
    assert [b.gradient_scaling_factor for b in buffers] == [0.5, 0.5]
