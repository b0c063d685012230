"""Megatron-Core's GPTModel (local spec) runs forward and backward on the CPU after apply("cpu"),
and the model-parallel RNG tracker really forks the device generator."""

from __future__ import annotations

import pytest
import torch

import megatron_npu

SEQ, VOCAB, BATCH = 64, 128, 2


@pytest.fixture
def gpt(gloo_world_of_one, cpu_adaptor):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(seed: int = 1234, dropout: float = 0.0) -> GPTModel:
        model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            use_cpu_initialization=True,
            hidden_dropout=dropout,
            attention_dropout=dropout,
        )
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        )

    return build


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).expand(BATCH, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens, position_ids, causal


def test_gpt_forward_backward_on_cpu(gpt):
    model = gpt()
    tokens, position_ids, mask = _batch()
    losses = model(tokens, position_ids, mask, labels=tokens)
    assert losses.shape == (BATCH, SEQ)
    loss = losses.mean()
    # an untrained model predicts close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 1.0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0


def test_gpt_logits_match_a_plain_recomputation_of_the_head(gpt):
    """The vocabulary head is a plain projection: logits = final hidden @ output weight.T."""
    model = gpt().eval()
    tokens, position_ids, mask = _batch()
    with torch.no_grad():
        logits = model(tokens, position_ids, mask)  # [b, s, v]
        captured = {}
        model.decoder.final_layernorm.register_forward_hook(
            lambda mod, inp, out: captured.setdefault("h", out)
        )
        model(tokens, position_ids, mask)
    hidden = captured["h"].transpose(0, 1)  # [s, b, h] -> [b, s, h]
    weight = model.output_layer.weight
    torch.testing.assert_close(logits, hidden @ weight.T, rtol=1e-5, atol=1e-5)


def _dropout_masks(seed: int, forks: int = 2) -> list[torch.Tensor]:
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(seed)
    masks = []
    for _ in range(forks):
        with get_cuda_rng_tracker().fork():
            masks.append(torch.nn.functional.dropout(torch.ones(4096), p=0.5) == 0)
    return masks


def test_rng_tracker_fork_makes_dropout_reproducible(gloo_world_of_one, cpu_adaptor):
    first, second = _dropout_masks(123)
    again_first, again_second = _dropout_masks(123)
    other_first, _ = _dropout_masks(124)
    assert torch.equal(first, again_first) and torch.equal(second, again_second)
    assert not torch.equal(first, second), "fork must advance and keep the tracker's state"
    assert not torch.equal(first, other_first), "another seed must give other masks"


def test_fork_isolates_the_default_stream_of_randomness(gloo_world_of_one, cpu_adaptor):
    """Random numbers drawn outside fork() are the same whether or not a fork happened."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    _dropout_masks(5, forks=0)
    plain = torch.rand(8)
    _dropout_masks(5, forks=0)
    with get_cuda_rng_tracker().fork():
        torch.rand(100)
    assert torch.equal(plain, torch.rand(8))


def test_model_dropout_same_seed_same_output_other_seed_differs(gpt):
    tokens, position_ids, mask = _batch()

    def run(seed):
        model = gpt(seed=1234, dropout=0.3).train()
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return model(tokens, position_ids, mask, labels=tokens)

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stock_megatron_cannot_fork_without_the_adaptor(gloo_world_of_one):
    """The same calls fail on a CUDA-less torch when the adaptor is not applied (test validity)."""
    megatron_npu.restore()
    with pytest.raises((AssertionError, RuntimeError)):
        _dropout_masks(1)
