"""The emulated MoE permutation kernels against torch_npu's documented examples and contract,
and the adaptor's choice between them and Megatron's unfused code.

The examples are those of torch_npu's own documentation of
``npu_moe_token_permute_with_routing_map`` / ``npu_moe_token_unpermute_with_routing_map``:
three tokens, two experts, every token to both.
"""

from __future__ import annotations

import pytest
import torch

from megatron_npu.ops.moe_permute import kernel_num_out_tokens
from megatron_npu.testing import torch_npu_emulation as emulation

TOKENS = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4], dtype=torch.float16)
BOTH = torch.ones(3, 2, dtype=torch.int8)


def test_permute_groups_the_copies_by_expert_and_maps_each_slot_to_its_row():
    permuted, probs, index_map = emulation.npu_moe_token_permute_with_routing_map(
        TOKENS, BOTH, num_out_tokens=6
    )
    assert probs is None
    assert torch.equal(permuted, torch.cat([TOKENS, TOKENS]))
    assert index_map.dtype == torch.int32
    assert index_map.tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(permuted[index_map.long()], TOKENS.repeat_interleave(2, dim=0))


def test_permute_carries_the_probs_in_the_rows_order():
    probs = torch.tensor([[0.5, 0.3], [0.4, 0.6], [0.2, 0.8]], dtype=torch.float16)
    _, permuted_probs, _ = emulation.npu_moe_token_permute_with_routing_map(
        TOKENS, BOTH, probs=probs, num_out_tokens=6
    )
    assert permuted_probs.tolist() == probs.t().flatten().tolist()


def test_drop_and_pad_keeps_capacity_rows_per_expert_selected_tokens_first():
    routing = torch.tensor([[0, 1], [1, 0], [1, 1]], dtype=torch.bool)
    permuted, _, token_of_row = emulation.npu_moe_token_permute_with_routing_map(
        TOKENS, routing, num_out_tokens=4, drop_and_pad=True
    )
    # expert 0 chose tokens 1 and 2; expert 1 chose 0 and 2
    assert token_of_row.tolist() == [1, 2, 0, 2]
    assert torch.equal(permuted, TOKENS[[1, 2, 0, 2]])
    # capacity 3: expert 0 pads with token 0, expert 1 with token 1
    _, _, token_of_row = emulation.npu_moe_token_permute_with_routing_map(
        TOKENS, routing, num_out_tokens=6, drop_and_pad=True
    )
    assert token_of_row.tolist() == [1, 2, 0, 0, 2, 1]


def test_unpermute_examples_of_the_documentation():
    rows = torch.tensor([[1.0] * 4, [2.0] * 4], dtype=torch.float16)
    index_map = torch.tensor([0, 1], dtype=torch.int32)
    routing = torch.tensor([[1, 0], [0, 1]], dtype=torch.int8)
    probs = torch.tensor([[1, 0], [0, 1]], dtype=torch.float16)
    out = emulation.npu_moe_token_unpermute_with_routing_map(
        rows, index_map, [2, 4], probs=probs, routing_map=routing
    )
    assert out.tolist() == [[1.0] * 4, [2.0] * 4]
    half = torch.tensor([[0.5, 0], [0, 0.5]], dtype=torch.float16)
    out = emulation.npu_moe_token_unpermute_with_routing_map(
        rows, index_map, [2, 4], probs=half, routing_map=routing, drop_and_pad=True
    )
    assert out.tolist() == [[0.5] * 4, [1.0] * 4]


def test_unpermute_inverts_permute_and_skips_unused_slots():
    permuted, _, index_map = emulation.npu_moe_token_permute_with_routing_map(
        TOKENS.float(), BOTH, num_out_tokens=6
    )
    out = emulation.npu_moe_token_unpermute_with_routing_map(permuted, index_map, [3, 4])
    assert torch.allclose(out, 2 * TOKENS.float())
    index_map = index_map.clone()
    index_map[1] = -1  # token 0's second copy is not summed
    out = emulation.npu_moe_token_unpermute_with_routing_map(permuted, index_map, [3, 4])
    assert torch.allclose(out[0], TOKENS[0].float()) and torch.allclose(
        out[1:], 2 * TOKENS[1:].float()
    )


@pytest.mark.parametrize(
    "call, error",
    [
        (
            lambda: emulation.npu_moe_token_permute_with_routing_map(
                TOKENS, torch.tensor([[1, 1], [1, 0], [0, 1]], dtype=torch.int8), num_out_tokens=6
            ),
            "every routing_map row must select topK = num_out_tokens // tokens_num = 2",
        ),
        (
            lambda: emulation.npu_moe_token_permute_with_routing_map(
                TOKENS, BOTH.float(), num_out_tokens=6
            ),
            "routing_map must be a 2-D bool or int8",
        ),
        (
            lambda: emulation.npu_moe_token_unpermute_with_routing_map(
                TOKENS, torch.tensor([0, 1, 2]), [3, 4]
            ),
            "sorted_indices must be a 1-D int32",
        ),
        (
            lambda: emulation.npu_moe_token_unpermute_with_routing_map(
                TOKENS, torch.tensor([0, 1, 2], dtype=torch.int32), [3, 4], probs=TOKENS[:, :2]
            ),
            "probs need routing_map",
        ),
    ],
    ids=["uneven-rows", "float-map", "int64-indices", "probs-without-map"],
)
def test_calls_the_kernel_would_reject_are_named(call, error):
    with pytest.raises((ValueError, TypeError), match=error):
        call()


def test_the_kernel_serves_only_maps_its_contract_covers():
    top2 = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert kernel_num_out_tokens(top2, 4, drop_and_pad=False) == 4
    assert kernel_num_out_tokens(top2, None, drop_and_pad=False) == 4
    uneven = torch.tensor([[1, 1, 0], [0, 0, 1]], dtype=torch.bool)  # a dropped choice
    assert kernel_num_out_tokens(uneven, 3, drop_and_pad=False) is None
    assert kernel_num_out_tokens(uneven, 6, drop_and_pad=True) == 6  # padding: any map
    assert kernel_num_out_tokens(uneven, None, drop_and_pad=True) is None
    assert kernel_num_out_tokens(uneven[:0], 0, drop_and_pad=False) is None
