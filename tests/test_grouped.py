"""Exact top-k dispatch with static shapes (``moe_model.grouped``): the grouped matrix
product's values and gradients, the pair sort, and the MoE layer's function."""

import pytest
import torch

from moe_model.grouped import grouped_dispatch, grouped_mm, grouped_mm_int8, sort_pairs
from protocol.codec import dequantize_int8, quantize_int8
from moe_model.models.moe import SparseMoeBlock


def test_grouped_mm_is_each_experts_product_on_its_rows_and_its_gradients_are_exact():
    torch.manual_seed(0)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 4, 4, 8])  # expert 1 has no rows; row 8 belongs to none
    y = grouped_mm(x, w, offsets)
    assert torch.allclose(y[:4], x[:4] @ w[0].t()) and torch.allclose(y[4:8], x[4:8] @ w[2].t())
    assert torch.equal(y[8], torch.zeros(5, dtype=torch.float64))
    g = torch.randn(9, 5, dtype=torch.float64)
    assert torch.allclose(grouped_mm(g, w, offsets, trans=True)[:4], g[:4] @ w[0])
    assert torch.autograd.gradcheck(lambda x, w: grouped_mm(x, w, offsets), (x, w))
    assert torch.autograd.gradcheck(lambda x, w: grouped_mm(x, w, offsets, trans=True),
                                    (torch.randn(9, 5, dtype=torch.float64, requires_grad=True), w))


def test_int8_grouped_mm_is_the_product_with_each_experts_dequantized_weight_and_only_x_has_a_gradient():
    torch.manual_seed(0)
    q, s = zip(*(quantize_int8(torch.randn(5, 4)) for _ in range(3)))
    w = torch.stack([dequantize_int8(a, b) for a, b in zip(q, s)])
    offsets = torch.tensor([0, 4, 4, 8])
    x = torch.randn(9, 4, requires_grad=True)
    y = grouped_mm_int8(x, list(q), list(s), offsets)
    assert torch.allclose(y, grouped_mm(x, w, offsets), atol=1e-6)
    g = torch.randn(9, 5)
    gx, = torch.autograd.grad(y, x, g)
    assert torch.allclose(gx, grouped_mm(g, w, offsets, trans=True), atol=1e-6)
    assert torch.equal(gx[8], torch.zeros(4))
    gt = torch.randn(9, 5, requires_grad=True)
    yt = grouped_mm_int8(gt, list(q), list(s), offsets, trans=True)
    assert torch.allclose(yt[:4], gt[:4] @ w[0], atol=1e-6)
    gg, = torch.autograd.grad(yt, gt, x.detach())  # the transposed product's gradient: the product itself
    assert torch.allclose(gg, grouped_mm(x.detach(), w, offsets), atol=1e-6)


@pytest.mark.parametrize("bad", ["float weight", "short scale", "one fewer scale", "fp64 scale"])
def test_int8_grouped_mm_refuses_weights_that_are_not_int8_rows_with_a_scale_each(bad):
    q, s = [torch.ones(5, 4, dtype=torch.int8)] * 3, [torch.ones(5)] * 3
    if bad == "float weight":
        q = [torch.ones(5, 4)] * 3
    elif bad == "short scale":
        s = [torch.ones(4)] * 3
    elif bad == "fp64 scale":
        s = [torch.ones(5, dtype=torch.float64)] * 3
    else:
        s = s[:2]
    with pytest.raises(ValueError, match="int8"):
        grouped_mm_int8(torch.randn(9, 4), q, s, torch.tensor([0, 4, 4, 8]))


@pytest.mark.parametrize("offsets, match", [([0, 4, 3, 8], "ascend"), ([1, 4, 4, 8], "ascend"),
                                            ([0, 4, 4, 10], "ascend"), ([0, 4, 9], "offsets")])
def test_grouped_mm_refuses_offsets_that_do_not_ascend_within_the_rows(offsets, match):
    with pytest.raises(ValueError, match=match):
        grouped_mm(torch.randn(9, 4), torch.randn(3, 5, 4), torch.tensor(offsets))


def test_pairs_are_sorted_by_expert_then_token():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])
    weight = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    token, expert, gate, offsets = sort_pairs(idx, weight, 4)
    assert token.tolist() == [0, 1, 1, 2, 0, 2] and expert.tolist() == [0, 0, 1, 1, 2, 2]
    assert gate.tolist() == pytest.approx([0.3, 0.6, 0.4, 0.5, 0.7, 0.5]) and offsets.tolist() == [0, 2, 4, 6, 6]


def test_a_moe_layer_under_grouped_dispatch_computes_its_sparse_function_and_gradients():
    torch.manual_seed(0)
    block = SparseMoeBlock(0, 8, 16, [3, 5, 6, 9], top_k=2)
    for p in block.router.rows.values():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 7, 8, requires_grad=True)
    want = block(x)
    gx, = torch.autograd.grad(want.sum(), x)
    block.grouped_dispatch = True
    got = block(x)
    gx2, = torch.autograd.grad(got.sum(), x)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(gx2, gx, atol=1e-6)
    experts = [block.experts[str(e)] for e in block.expert_ids]
    flat = x.detach().reshape(-1, 8)
    rec = block.last
    assert torch.allclose(grouped_dispatch(experts, flat, rec.topk_idx, rec.topk_weight), want.reshape(-1, 8),
                          atol=1e-6)
