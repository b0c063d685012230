"""One TP1 training step of a compute-bound GPT: the adaptor's Megatron run vs plain PyTorch.

* ``megatron-npu``: the step ``megatron-npu train`` runs (:class:`~megatron_npu.training.loop.
  Trainer`, one gloo rank on ``cpu``, fused attention via ``--use-flash-attn``, Megatron's
  schedule, DDP grad buffer and optimizer);
* ``plain-torch``: the same model written plainly (:mod:`perf.plain_gpt`), same SDPA kernel.

Target: megatron-npu within 1.15x of plain-torch (compare the medians of the group). Both record
the model FLOPs per step (Megatron-LM's formula, :mod:`megatron_npu.training.flops`) and their
MFU against the host's measured GEMM peak (:mod:`megatron_npu.training.peak`).

The megatron-npu cell also records ``routing_share``: one more step under ``cProfile``, the time
spent inside the device routing (``megatron_npu/devices``) over the step's profiled time (target:
under 1 %). The profiler taxes every Python call, the routing is all Python calls, so the share
is an upper bound.

Size: 8 layers, hidden 1024, 16 heads, sequence 1024, vocab 32000, micro-batch 1, fp32.

``test_gpt_train_step_by_precision`` runs one ``megatron-npu train`` step of a 4-layer model on
``cpu`` in fp32, bf16 and fp16 (group ``gpt-train-step-precision``). Target: each 16-bit step
within 1.3x of the fp32 step, which the ``matmul.*`` patches make possible (16-bit products as
one fp32 product rounded once; ``perf/README.md`` has the figures with and without them).
"""

from __future__ import annotations

import cProfile
import os
import pstats

import pytest
import torch

import megatron_npu
from megatron_npu import devices
from megatron_npu.data.tokenizers import null_vocab_size_for
from megatron_npu.ops.settings import reset as reset_fused_attention
from megatron_npu.ops.settings import set_fused_attention
from megatron_npu.training import arguments, data, flops, launch, loop
from perf.plain_gpt import GPTShape, PlainTrainer
from perf.runner import record_mfu

SHAPES = {
    "full": GPTShape(8, 1024, 16, 1024, 32000, 1),
    "quick": GPTShape(2, 128, 4, 128, 1024, 1),
}
DTYPE = torch.float32
GROUP = "gpt-train-step"
_ROUTING = os.path.join("megatron_npu", "devices", "")


def _argv(shape: GPTShape, precision: str = "fp32") -> list[str]:
    flag = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--loss-scale", "4096"]}[precision]
    return [
        *flag,
        "--device",
        "cpu",
        "--mock-data",
        "--vocab-size",
        str(null_vocab_size_for(shape.vocab_size)),
        "--num-layers",
        str(shape.num_layers),
        "--hidden-size",
        str(shape.hidden_size),
        "--num-attention-heads",
        str(shape.num_attention_heads),
        "--seq-length",
        str(shape.seq_length),
        "--micro-batch-size",
        str(shape.micro_batch_size),
        "--global-batch-size",
        str(shape.micro_batch_size),
        "--train-iters",
        "1000",
        "--lr",
        "1e-4",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--use-flash-attn",
        "--log-interval",
        "1000",
        "--progress",
        "plain",
        "--make-vocab-size-divisible-by",
        "128",
    ]


def _model_flops(shape: GPTShape) -> float:
    return flops.gpt_model_flops_per_iteration(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_attention_heads,
        seq_length=shape.seq_length,
        padded_vocab_size=shape.vocab_size,
        global_batch_size=shape.micro_batch_size,
        swiglu=False,
        causal=True,
    )


class _MegatronStep:
    """An in-process, one-rank ``megatron-npu train`` set up to its first step."""

    def __init__(self, shape: GPTShape, precision: str = "fp32") -> None:
        self.args = arguments.parse_args(_argv(shape, precision))
        megatron_npu.apply("cpu")
        self.device = devices.require_active()
        set_fused_attention(use_flash_attn=True, shape_order="SBH")
        self.env = launch.dist_env()
        launch.init_process_group(self.env, self.device, 10)
        self.trainer = loop.build_trainer(self.args, self.env, self.device)
        assert self.trainer.vocab == shape.vocab_size, "the plain model must have the same vocab"
        self.iterators = data.iterators(self.args, self.trainer.train_data, self.trainer.model, 0)
        for chunk in self.trainer.model:
            chunk.train()
        self.count = 0

    def step(self) -> float:
        self.count += 1
        loss, _, _, skipped = self.trainer.step(self.count, self.iterators)
        assert not skipped and loss is not None
        return loss

    def routing_share(self) -> float:
        """Share of one profiled step spent in ``megatron_npu/devices`` (an upper bound)."""
        profile = cProfile.Profile()
        profile.runcall(self.step)
        stats = pstats.Stats(profile).stats
        total = sum(entry[2] for entry in stats.values())  # tottime of every function
        routing = sum(entry[2] for (path, _, _), entry in stats.items() if _ROUTING in path)
        return routing / total

    def close(self) -> None:
        from megatron.core import parallel_state

        launch.shutdown()
        parallel_state.destroy_model_parallel()
        reset_fused_attention()
        megatron_npu.restore()


@pytest.mark.parametrize("path", ["megatron-npu", "plain-torch"])
def test_gpt_train_step(benchmark, perf_size, path):
    shape = SHAPES[perf_size]
    torch.manual_seed(0)
    runner = _MegatronStep(shape) if path == "megatron-npu" else PlainTrainer(shape, DTYPE)
    model_flops = _model_flops(shape)
    benchmark.group = GROUP
    benchmark.extra_info.update(
        patch_id=None,
        op=GROUP,
        path=path if path == "plain-torch" else "native",
        device="cpu",
        emulated=False,
        dtype="float32",
        direction="step",
        shape=f"L={shape.num_layers},h={shape.hidden_size},n={shape.num_attention_heads},"
        f"s={shape.seq_length},V={shape.vocab_size},b={shape.micro_batch_size}",
        peak_memory_bytes=None,
        torch_threads=torch.get_num_threads(),
        case=path,
    )
    losses: list[float] = []
    try:
        benchmark.pedantic(
            lambda: losses.append(runner.step()), rounds=3, iterations=1, warmup_rounds=1
        )
        if isinstance(runner, _MegatronStep):
            benchmark.extra_info["routing_share"] = runner.routing_share()
    finally:
        if isinstance(runner, _MegatronStep):
            runner.close()
    record_mfu(benchmark, model_flops, "cpu", DTYPE)
    assert all(torch.isfinite(torch.tensor(losses)))


#: the 4-layer model of the precision group (hidden 256, 8 heads, sequence 256, micro-batch 4)
PRECISION_SHAPES = {
    "full": GPTShape(4, 256, 8, 256, 1024, 4),
    "quick": GPTShape(2, 128, 4, 128, 1024, 1),
}
PRECISION_GROUP = "gpt-train-step-precision"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpt_train_step_by_precision(benchmark, perf_size, precision):
    """The same ``megatron-npu train`` step on ``cpu`` in fp32, bf16 and fp16 (a static loss
    scale, so no step is skipped). Target: the 16-bit steps within 1.3x of the fp32 step; their
    matrix products are fp32 products rounded once (the ``matmul.*`` patches), so the 16-bit
    steps pay only for the casts and the mixed-precision optimizer's copies."""
    shape = PRECISION_SHAPES[perf_size]
    torch.manual_seed(0)
    runner = _MegatronStep(shape, precision)
    benchmark.group = PRECISION_GROUP
    benchmark.extra_info.update(
        patch_id=None,
        op=PRECISION_GROUP,
        path="native",
        device="cpu",
        emulated=False,
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision],
        direction="step",
        peak_memory_bytes=None,
        torch_threads=torch.get_num_threads(),
        shape=f"L={shape.num_layers},h={shape.hidden_size},n={shape.num_attention_heads},"
        f"s={shape.seq_length},V={shape.vocab_size},b={shape.micro_batch_size}",
        case=precision,
    )
    losses: list[float] = []
    try:
        benchmark.pedantic(
            lambda: losses.append(runner.step()), rounds=3, iterations=1, warmup_rounds=1
        )
    finally:
        runner.close()
    assert all(torch.isfinite(torch.tensor(losses)))
