"""Make an msprobe dump (level L0, task tensor) of one training step of a small Llama-style
Megatron-Core GPT (RMSNorm, SwiGLU, no linear bias) through the adaptor on one device:
``python _msprobe_megatron_dump.py DEVICE OUT``. On ``npu-emulated`` the norms run the emulated
``npu_rms_norm`` kernel; ``tests/compare/plants``' ``rms-norm-2pct`` (through
``MEGATRON_NPU_TEST_PLANT`` and that folder on ``PYTHONPATH``) makes it 2 % off there, a fused
kernel's bug, while the cpu reference runs the native path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SEQ, VOCAB, BATCH = 32, 128, 2


def main() -> None:
    device, out = sys.argv[1:3]
    import megatron_npu

    megatron_npu.apply(device)
    # one rank: an in-process store, no port to pick
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from msprobe.pytorch import PrecisionDebugger

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    settings = Path(out) / "config.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(
        json.dumps(
            {
                "task": "tensor",
                "dump_path": str(Path(out) / "dump"),
                "rank": [],
                "step": [],
                "level": "L0",
                "async_dump": False,
                "tensor": {"scope": [], "list": [], "data_mode": ["all"]},
            }
        )
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    debugger = PrecisionDebugger(config_path=str(settings))
    debugger.start(model=model)
    model(tokens, position_ids, mask, labels=tokens).mean().backward()
    debugger.stop()
    debugger.step()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
