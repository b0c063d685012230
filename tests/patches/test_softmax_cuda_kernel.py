"""``softmax.cuda-kernel-missing``: on a GPU without Megatron's fused-softmax CUDA extensions
(pip's megatron-core ships none; apex or a Megatron-LM source build compiles them), Megatron
picks its fused path for 16-bit scores and stops at the import. With the wrap, Megatron's own
torch softmax serves and one line names the missing extension.

The entry is a ``cuda`` one; the tests install it through the patcher with its device widened
to this host's (``MEGATRON_NPU_DISABLE`` is honoured), where the extensions are missing too."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types

import pytest
import torch

import megatron_npu
from megatron_npu.devices.facts import CUDA
from megatron_npu.patches import softmax as softmax_patch
from megatron_npu.registry import all_patches

_ID = "softmax.cuda-kernel-missing"


@pytest.fixture
def cuda_entry_here():
    """The entry applied on this host, with its one-line memory cleared."""
    softmax_patch._say_missing.cache_clear()
    entry = {p.id: p for p in all_patches()}[_ID]
    megatron_npu.apply("cpu", patches=[dataclasses.replace(entry, devices=frozenset({"cpu"}))])
    yield
    megatron_npu.restore()


def _softmax(causal=True, fusion=True, dtype=torch.float16):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(
        input_in_fp16=dtype == torch.float16,
        input_in_bf16=dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.padding,
        scaled_masked_softmax_fusion=fusion,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )


def _reference(scores, mask):
    """Softmax in fp32 of the scores Megatron's mask function leaves, rounded once: what its
    torch path computes."""
    return torch.softmax(scores.float().masked_fill(mask, -10000.0), dim=-1).to(scores.dtype)


def test_missing_extension_is_one_line_and_the_torch_softmax(cuda_entry_here, capsys):
    """fp16 scores of a shape Megatron's kernel takes (b*np and lengths multiples of 4) with a
    padding mask: twice through the forward, the torch path's result both times and one line
    in all."""
    torch.manual_seed(0)
    scores = torch.randn(2, 4, 64, 64).half()
    mask = torch.rand(2, 1, 64, 64) < 0.3
    softmax = _softmax(causal=False)
    for _ in range(2):
        out = softmax(scores, mask)
        torch.testing.assert_close(out, _reference(scores, mask), rtol=0, atol=1e-3)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "megatron-npu: masked-softmax fusion: Megatron's CUDA extension "
        "scaled_masked_softmax_cuda is not installed; its torch softmax serves (the "
        "--no-masked-softmax-fusion path)"
    ]


@pytest.mark.parametrize(
    "causal, masked, extension",
    [
        (True, False, "scaled_upper_triang_masked_softmax_cuda"),
        (False, True, "scaled_masked_softmax_cuda"),
        (False, False, "scaled_softmax_cuda"),
    ],
)
def test_the_extension_the_call_would_import_decides(
    cuda_entry_here, monkeypatch, capsys, causal, masked, extension
):
    """With the batch-per-block helper present (a stand-in ``scaled_masked_softmax_cuda``
    module) Megatron's rule says yes; the answer is then whether the extension that call imports
    is installed."""
    helper = types.ModuleType("scaled_masked_softmax_cuda")
    helper.__spec__ = importlib.machinery.ModuleSpec("scaled_masked_softmax_cuda", None)
    helper.get_batch_per_block = lambda sq, sk, b, np: 4
    monkeypatch.setitem(sys.modules, "scaled_masked_softmax_cuda", helper)
    mask = torch.zeros(2, 1, 64, 64, dtype=torch.bool) if masked else None
    available = _softmax(causal=causal).is_kernel_available(mask, 2, 4, 64, 64)
    assert available is (extension == "scaled_masked_softmax_cuda")
    err = capsys.readouterr().err
    assert (extension in err) is (not available)


def test_fp32_scores_and_fusion_off_say_nothing(cuda_entry_here, capsys):
    """Where Megatron would not fuse anyway the answer is its own, without a line."""
    assert not _softmax(dtype=torch.float32).is_kernel_available(None, 2, 4, 64, 64)
    assert not _softmax(fusion=False).is_kernel_available(None, 2, 4, 64, 64)
    assert capsys.readouterr().err == ""


def test_it_is_a_cuda_entry_only():
    entry = {p.id: p for p in all_patches()}[_ID]
    assert entry.devices == frozenset({CUDA}) and entry.kind == "wrap"
