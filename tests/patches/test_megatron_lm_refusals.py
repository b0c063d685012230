"""What the adaptor refuses of Megatron-LM's options: one line per option, starting with the
option, and where the line tells the user to shard or train another way, that way is an option
of the Megatron-LM release paired with the installed megatron-core and the adaptor serves it
(neither refused by name nor by Megatron's own FSDP2 failures)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megatron_npu.patches import megatron_lm
from tests.megatron_lm._client import megatron_lm_folder

#: a value of each trigger kind that asks for the refused feature
_ASKING = {"not-none": "local", "above-1": 2, "set": "x", "fp8-dtype": "fp8"}


def _refused(**args) -> list[str]:
    return megatron_lm.refusals(SimpleNamespace(**args))


@pytest.mark.parametrize(
    "name, trigger, option",
    [(name, trigger, option) for name, trigger, option, _ in megatron_lm.UNSUPPORTED],
    ids=[f"{option}-{name}" for name, _, option, _ in megatron_lm.UNSUPPORTED],
)
def test_a_refused_option_is_one_line_and_the_way_it_names_is_served(name, trigger, option):
    lines = _refused(**{name: _ASKING.get(trigger, trigger)})
    assert len(lines) == 1 and lines[0].startswith(f"{option}: "), lines
    arguments = (megatron_lm_folder() / "megatron" / "training" / "arguments.py").read_text()
    for suggested in re.findall(r"\b(?:with|use) (--[a-z0-9-]+)", lines[0]):
        assert f"'{suggested}'" in arguments, (option, suggested)  # Megatron-LM has it
        assert _refused(**{suggested[2:].replace("-", "_"): True}) == [], (option, suggested)


def test_core_v013s_custom_fsdp_is_refused_and_megatron_fsdp_is_served():
    """core_v0.13's ``--use-custom-fsdp`` (no ``use_megatron_fsdp`` argument yet) is one line
    naming what to use; from 0.14 Megatron-LM sets ``use_custom_fsdp`` beside
    ``--use-megatron-fsdp``, which is served."""
    [line] = _refused(use_custom_fsdp=True)
    assert line.startswith("--use-custom-fsdp: ") and "use --use-distributed-optimizer" in line
    served = _refused(use_custom_fsdp=True, use_megatron_fsdp=True)
    if _megatron_fsdp_refused_as_a_whole():
        assert len(served) == 1 and served[0].startswith("--use-megatron-fsdp: "), served
    else:
        assert served == []


def _megatron_fsdp_refused_as_a_whole() -> bool:
    """megatron-core 0.14's Megatron-FSDP on torch 2.13 (it reads DeviceMesh state torch
    removed), which one line refuses whatever its options."""
    from megatron_npu.patches import megatron_fsdp

    return megatron_fsdp._reads_removed_mesh_state()


def _served_megatron_fsdp_before(release: str) -> bool:
    """Whether the installed megatron-core, whose Megatron-FSDP the adaptor serves, is older than
    ``release``; the test is skipped where Megatron-FSDP is absent or refused as a whole."""
    pytest.importorskip(
        "megatron.core.distributed.fsdp.src.megatron_fsdp",
        reason="megatron-core 0.13 has no Megatron-FSDP (its forerunner is refused)",
    )
    if _megatron_fsdp_refused_as_a_whole():
        pytest.skip("megatron-core 0.14 on torch 2.13: Megatron-FSDP is refused as a whole")
    from packaging.version import Version

    from megatron_npu.patcher import megatron_core_version

    return Version(megatron_core_version()) < Version(release)


def test_megatron_fsdps_no_shard_is_refused_where_megatrons_gather_fails():
    """No-shard Megatron-FSDP: megatron-core before 0.18 gathers the parameters after each step
    from a weight buffer no_shard does not build (refused in one line, with the way out);
    ``--overlap-param-gather`` takes the other path, and 0.18+ gathers no_shard itself."""
    fails = _served_megatron_fsdp_before("0.18")
    asked = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "no_shard"}
    lines = _refused(**asked)
    assert len(lines) == fails
    if fails:
        assert lines[0].startswith("--data-parallel-sharding-strategy no_shard: ")
        assert "add --overlap-grad-reduce --overlap-param-gather" in lines[0]
    assert _refused(**asked, overlap_param_gather=True) == []
    assert _refused(**{**asked, "data_parallel_sharding_strategy": "optim"}) == []


def test_megatron_fsdp_with_the_precision_aware_optimizer_is_refused_in_one_line():
    """Before megatron-core 0.18 Megatron-FSDP attaches each gradient as ``.grad`` and the
    precision-aware optimizer reads ``decoupled_grad``: the run would train nothing (Megatron's
    own code). From 0.18 it hands them over, but its parameters are DTensors, which the
    adaptor's precision-aware optimizer does not step. One line either way; the distributed
    optimizer serves the precision-aware optimizer."""
    before = _served_megatron_fsdp_before("0.18")
    [line] = _refused(use_megatron_fsdp=True, use_precision_aware_optimizer=True)
    assert line.startswith("--use-precision-aware-optimizer: ")
    assert ("decoupled_grad" in line) == before and ("DTensor" in line) != before
    assert "use --use-distributed-optimizer" in line
    assert _refused(use_distributed_optimizer=True, use_precision_aware_optimizer=True) == []


@pytest.mark.parametrize(
    "asked, refused",
    [
        ({"optimizer": "sgd", "use_distributed_optimizer": True}, True),
        ({"optimizer": "sgd", "use_megatron_fsdp": True}, True),
        ({"optimizer": "sgd"}, False),
        ({"optimizer": "adam", "use_distributed_optimizer": True}, False),
        (
            {
                "optimizer": "sgd",
                "use_distributed_optimizer": True,
                "optimizer_cpu_offload": True,
                "bf16": True,
            },
            False,
        ),
    ],
)
def test_sgd_with_the_distributed_optimizer_is_one_line_as_megatrons_assertion(asked, refused):
    """megatron-core's DistributedOptimizer asserts Adam (or its host-offloaded hybrid) when it
    is built, on every rank; the adaptor says so once, before anything is built. The assertion
    is still Megatron's: the test reads it from the installed source."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert "Only Adam" in inspect.getsource(DistributedOptimizer.__init__)
    lines = megatron_lm.distributed_optimizer_problems(SimpleNamespace(**asked))
    assert len(lines) == refused
    if refused:
        assert lines[0].startswith("--optimizer sgd: ") and "--optimizer adam" in lines[0]


@pytest.mark.parametrize(
    "precision, refused", [({}, True), ({"bf16": True}, False), ({"fp16": True}, False)]
)
def test_offload_of_an_fp32_model_is_one_line_as_torchs_refusal(precision, refused):
    """``--optimizer-cpu-offload`` with an fp32 model: megatron-core's distributed optimizer
    builds its ``HybridDeviceOptimizer`` on the fp32 parameters' shards, views of the
    parameters, and torch's optimizer constructor refuses a non-leaf tensor, before anything of
    the device is touched. The adaptor says so once; the refusal itself is megatron-core's
    class's, checked here."""
    import torch
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    shard = torch.nn.Parameter(torch.ones(8)).view(-1)[2:6]  # how an fp32 shard is taken
    with pytest.raises(ValueError, match="non-leaf"):
        HybridDeviceOptimizer(
            [{"params": [shard]}],
            offload_fraction=0.5,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            param_update_in_fp32=True,
        )
    asked = {"use_distributed_optimizer": True, "optimizer_cpu_offload": True, **precision}
    lines = megatron_lm.distributed_optimizer_problems(SimpleNamespace(**asked))
    assert len(lines) == refused
    if refused:
        assert lines[0].startswith("--optimizer-cpu-offload without --bf16 or --fp16: ")


@pytest.mark.parametrize(
    "asked, refused",
    [
        ({"fp16": True}, True),
        ({"fp16": True, "accumulate_allreduce_grads_in_fp32": True}, False),
        ({"fp16": True, "clip_grad": 0.0}, False),
        ({"bf16": True}, False),  # Megatron-LM accumulates bf16's gradients in fp32 itself
    ],
    ids=["fp16", "fp16-fp32-grads", "fp16-no-clipping", "bf16"],
)
def test_precision_aware_fp16_is_one_line_as_megatron_cores_clipping_assertion(
    cpu_adaptor, asked, refused
):
    """``--use-precision-aware-optimizer --fp16`` keeps each main gradient in fp16 unless
    ``--accumulate-allreduce-grads-in-fp32``, and megatron-core's gradient clipping asserts an
    fp32 or bf16 ``decoupled_grad`` at the first applied update (a traceback on every rank,
    any device). The adaptor says so once; the assertion itself is megatron-core's, checked
    here on such a gradient and on the one the option gives (the two differ in dtype alone)."""
    import torch
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    def clip(grad_dtype):
        param = torch.nn.Parameter(torch.ones(4))
        param.decoupled_grad = torch.ones(4, dtype=grad_dtype)
        clip_grad_by_total_norm_fp32([param], 1.0, 4.0, use_decoupled_grad=True)
        return param.decoupled_grad

    with pytest.raises(AssertionError):
        clip(torch.float16)
    assert torch.allclose(clip(torch.float32), torch.full((4,), 0.25), atol=1e-4)
    args = {
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
        "accumulate_allreduce_grads_in_fp32": False,
        "clip_grad": 1.0,
        **asked,
    }
    lines = megatron_lm.distributed_optimizer_problems(SimpleNamespace(**args))
    assert len(lines) == refused, lines
    if refused:
        assert lines[0].startswith("--use-precision-aware-optimizer with --fp16: ")
        assert lines[0].endswith("add --accumulate-allreduce-grads-in-fp32")
