"""train's micro-batches carry tokens, labels, loss mask and positions, and no attention mask:
the loop hands attention the shared causal mask of the sequence, so a dense [s, s] mask per
sample would only be built, collated and copied on the host while the device waits. On an
accelerator the loader pins them, as Megatron-LM's does, so that their copies queue behind the
device's work instead of waiting for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_npu.training import arguments, data


def _args(seq: int, micro: int):
    return arguments.parse_args(
        [
            "--mock-data", "--vocab-size", "256", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", str(seq), "--micro-batch-size",
            str(micro), "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
        ]
    )  # fmt: skip


def test_a_micro_batch_is_tokens_and_their_positions_alone(gloo_world_of_one):
    seq, micro = 64, 2
    args = _args(seq, micro)
    dataset = data.build_train_data(args).dataset
    sample = dataset[0]
    assert "attention_mask" not in sample
    assert {k: tuple(v.shape) for k, v in sample.items()} == {
        "tokens": (seq,), "labels": (seq,), "loss_mask": (seq,), "position_ids": (seq,),
    }  # fmt: skip


# torch_npu's "npu" is torch's PrivateUse1 device type renamed (this torch has no torch_npu)
@pytest.mark.parametrize(
    "device, pinned", [("cuda", True), ("privateuseone", True), ("cpu", False)], ids=str
)
def test_the_loader_pins_batches_on_an_accelerator_alone(
    gloo_world_of_one, monkeypatch, device, pinned
):
    """The loader train builds for its chunks asks for page-locked batches where the active
    device has memory of its own (recorded at construction: this host has no accelerator to
    pin for)."""
    args = _args(64, 2)
    train_data = data.build_train_data(args)
    built = []

    class Recording(torch.utils.data.DataLoader):
        def __init__(self, *a, **kw):
            built.append(kw["pin_memory"])
            super().__init__(*a, **{**kw, "pin_memory": False})

    monkeypatch.setattr(torch.utils.data, "DataLoader", Recording)
    monkeypatch.setattr(data.devices, "current_torch_device", lambda: torch.device(device))
    chunk = SimpleNamespace(pre_process=True, post_process=True)
    monkeypatch.setattr("megatron_npu.training.model.unwrap", lambda c: c)
    (iterator,) = data.iterators(args, train_data, [chunk], consumed_samples=0)
    assert next(iterator)["tokens"].shape == (2, 64)
    assert built == [pinned]
