"""The mock-data backport (``data.mock-token-ids-in-vocab``, megatron-core < 0.16): Megatron's
mock GPT samples must stay inside the tokenizer's vocabulary, as 0.16 does by itself."""

from __future__ import annotations

from types import SimpleNamespace

import numpy

import megatron_npu


def test_mock_samples_stay_inside_the_vocab():
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    vocab, eod = 50, 49
    megatron_npu.apply("cpu")
    try:
        dataset = MockGPTLowLevelDataset(SimpleNamespace(vocab_size=vocab, eod=eod))
        longest = int(numpy.argmax(dataset.sequence_lengths))  # longer than the vocab
        assert dataset.sequence_lengths[longest] > vocab
        sample = dataset[longest]
    finally:
        megatron_npu.restore()
    assert sample[-1] == eod
    assert 0 <= sample[:-1].min() and sample[:-1].max() < vocab
