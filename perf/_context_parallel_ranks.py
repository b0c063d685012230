"""What each rank of the context-parallel step benchmark runs (``test_context_parallel_bench.py``).

A GPT of Megatron's TE spec (the adaptor's TE classes; context parallelism needs them) with
flash attention (``--use-flash-attn``: CP1 runs the fused op, CP2 the ring's fused blocks) on a
gloo group of ``cp`` ranks, one training step (forward, loss, backward) of one sequence that
Megatron's own ``get_batch_on_this_cp_rank`` splits; the peak bytes torch allocated during one
step (:func:`perf.memory.peak_allocated_bytes`) and the median wall time of the timed steps.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any


def _model(seq: int, hidden: int, heads: int, layers: int, cp: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        context_parallel_size=cp,
    )
    return GPTModel(
        config,
        get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=1024,
        max_sequence_length=seq,
    )


def worker(rank: int, cp: int, store: str, shape: dict[str, int], steps: int, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import megatron_npu
    from perf.memory import peak_allocated_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cp)
    megatron_npu.apply("cpu")
    from megatron_npu.ops import settings

    # CP1's attention the fused (flash) op, as the ring's blocks are: like for like
    settings.set_fused_attention(use_flash_attn=True)
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.utils import get_batch_on_this_cp_rank

        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
        model_parallel_cuda_manual_seed(0)
        seq = shape["seq"]
        model = _model(seq, shape["hidden"], shape["heads"], shape["layers"], cp)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 1024, (1, seq + 1), generator=gen)
        batch = get_batch_on_this_cp_rank(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "position_ids": torch.arange(seq).unsqueeze(0),
            }
        )

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss.float().mean().backward()

        step()  # warm-up: lazy initialisation is not the step's memory or time
        peak = peak_allocated_bytes(step)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        results.put((rank, {"peak_bytes": peak, "step_s": statistics.median(times)}))
        parallel_state.destroy_model_parallel()
    finally:
        settings.reset()
        megatron_npu.restore()
        dist.destroy_process_group()
