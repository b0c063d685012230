"""train's micro-batches carry tokens, labels, loss mask and positions, and no attention mask:
the loop hands attention the shared causal mask of the sequence, so a dense [s, s] mask per
sample would only be built, collated and copied on the host while the device waits."""

from __future__ import annotations

from megatron_npu.training import arguments, data


def test_a_micro_batch_is_tokens_and_their_positions_alone(gloo_world_of_one):
    seq, micro = 64, 2
    args = arguments.parse_args(
        [
            "--mock-data", "--vocab-size", "256", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", str(seq), "--micro-batch-size",
            str(micro), "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
        ]
    )  # fmt: skip
    dataset = data.build_train_data(args).dataset
    sample = dataset[0]
    assert "attention_mask" not in sample
    assert {k: tuple(v.shape) for k, v in sample.items()} == {
        "tokens": (seq,), "labels": (seq,), "loss_mask": (seq,), "position_ids": (seq,),
    }  # fmt: skip
