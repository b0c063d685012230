"""The emulated gating kernels against torch_npu's documented definition, and where the adaptor
lets them stand in for Megatron's routing.

``npu_moe_gating_top_k`` (sigmoid, ``norm_type=1``): the scores are the sigmoid of the logits,
the bias only chooses, groups are scored by their best one or two, and the chosen scores are
divided by their sum (plus eps) and scaled. The backward kernel is checked against torch's
autograd through that definition.
"""

from __future__ import annotations

import pytest
import torch

from megatron_npu.ops.moe_router import gating_kernel_groups
from megatron_npu.testing import torch_npu_emulation as emulation


def _definition(x, k, bias, scale):
    scores = torch.sigmoid(x)
    chosen = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale, chosen


def test_sigmoid_gating_chooses_by_the_biased_scores_and_weights_by_the_unbiased():
    x = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 is chosen for its bias alone
    y, idx, scores = emulation.npu_moe_gating_top_k(
        x, 2, bias=bias, norm_type=1, out_flag=True, routed_scaling_factor=2.0
    )
    assert idx.dtype == torch.int32 and idx.tolist() == [[3, 0]]
    s = torch.sigmoid(x)[0]
    assert torch.allclose(y[0], torch.stack([s[3], s[0]]) / (s[3] + s[0]) * 2.0)
    assert torch.equal(scores, torch.sigmoid(x))  # out_flag: the fp32 scores, without bias


def test_groups_are_kept_by_their_best_or_their_two_best():
    # two groups of 3: group 0 holds the single best expert, group 1 the better pair
    x = torch.tensor([[3.0, -3.0, -3.0, 1.5, 1.5, -3.0]])
    _, best, _ = emulation.npu_moe_gating_top_k(
        x, 1, k_group=1, group_count=2, group_select_mode=0, norm_type=1
    )
    _, pair, _ = emulation.npu_moe_gating_top_k(
        x, 1, k_group=1, group_count=2, group_select_mode=1, norm_type=1
    )
    assert best.tolist() == [[0]] and pair.tolist() == [[3]]


def test_the_backward_kernel_is_the_gradient_of_the_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, requires_grad=True)
    bias = torch.randn(8, generator=g) * 0.1
    grad = torch.randn(5, 3, generator=g)
    y, chosen = _definition(x, 3, bias, 2.5)
    (y * grad).sum().backward()
    _, idx, scores = emulation.npu_moe_gating_top_k(
        x.detach(), 3, bias=bias, norm_type=1, out_flag=True, routed_scaling_factor=2.5
    )
    assert torch.equal(idx.long(), chosen)
    got = emulation.npu_moe_gating_top_k_backward(
        scores, grad, idx, norm_type=1, routed_scaling_factor=2.5
    )
    assert torch.allclose(got, x.grad, atol=1e-6)


@pytest.mark.parametrize(
    "call, error",
    [
        (
            lambda: emulation.npu_moe_gating_top_k(torch.zeros(2, 6), 2, group_count=4),
            "group_count 4 must divide the 6 experts",
        ),
        (lambda: emulation.npu_moe_gating_top_k(torch.zeros(2, 6), 7), "k 7 must be in"),
        (lambda: emulation.npu_moe_gating_top_k(torch.zeros(2, 6), 2, renorm=1), "renorm 0"),
        (
            lambda: emulation.npu_moe_gating_top_k_backward(
                torch.zeros(2, 6), torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.int32)
            ),
            "only norm_type 1",
        ),
    ],
    ids=["groups", "k", "renorm", "softmax-backward"],
)
def test_calls_the_kernel_would_reject_are_named(call, error):
    with pytest.raises((ValueError, TypeError), match=error):
        call()


@pytest.mark.parametrize(
    "dtype, topk, score, groups, expected",
    [
        (torch.float32, 2, "sigmoid", (None, None), (1, 1, 0)),
        (torch.float32, 4, "sigmoid", (4, 2), (4, 2, 1)),  # each group scored by its best 2
        (torch.float32, 2, "sigmoid", (4, 2), (4, 2, 0)),  # ... by its best one
        (torch.float32, 6, "sigmoid", (4, 2), None),  # by its best 3: not the kernel's
        (torch.float32, 1, "sigmoid", (None, None), None),  # top-1: Megatron does not normalise
        (torch.float32, 2, "softmax", (None, None), None),  # no softmax backward kernel
        (torch.bfloat16, 2, "sigmoid", (None, None), None),  # Megatron rounds before choosing
    ],
)
def test_the_kernel_serves_only_routings_that_are_megatrons(dtype, topk, score, groups, expected):
    logits = torch.zeros(3, 16, dtype=dtype)
    assert gating_kernel_groups(logits, topk, score, *groups) == expected
