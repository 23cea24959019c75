"""Activation statistics on hand-made routing decisions."""

import torch

from moe_model.models.moe import RoutingRecord, SparseMoeBlock
from moe_model.stats import ActivationStats


def block_with(probs, experts=(1, 3), top_k=1, hidden=None):
    b = SparseMoeBlock(2, 4, 8, list(experts), top_k)
    probs = torch.tensor(probs, dtype=torch.float32)
    w, idx = probs.topk(top_k, -1)
    b.last = RoutingRecord(probs, idx, w / w.sum(-1, keepdim=True), hidden)
    return b


def test_usage_margin_routing_and_majority_expert():
    # 2 samples x 3 tokens; the last token of sample 1 is padding
    probs = [[.9, .1], [.8, .2], [.3, .7],   # sample 0: experts 1,1,3 -> majority 1
             [.4, .6], [.2, .8], [.5, .5]]   # sample 1: 3,3,(pad)
    b = block_with(probs)
    s = ActivationStats({2: b}, num_experts=4)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    s.add_train(mask, sample_loss=torch.tensor([1.0, 3.0]), sample_correct=torch.tensor([True, False]))
    (ls,) = s.layer_stats()
    assert ls.layer == 2 and ls.tokens == 5
    assert ls.usage == [0, 2, 0, 3]
    assert ls.routing_dist == [0, 0.4, 0, 0.6]  # top-1: renormalised weight 1 per token
    assert abs(ls.margin[1] - ((.9 - .1) + (.8 - .2)) / 2) < 1e-6
    assert abs(ls.margin[3] - ((.7 - .3) + (.6 - .4) + (.8 - .2)) / 3) < 1e-6
    assert ls.expert_samples == [0, 1, 0, 1]
    assert ls.expert_loss == [None, 1.0, None, 3.0] and ls.expert_acc == [None, 1.0, None, 0.0]


def test_validation_activation_probability_top_k_counted():
    b = block_with([[.6, .4], [.3, .7]], top_k=2)
    s = ActivationStats({2: b}, num_experts=4)
    s.add_validation(torch.tensor([[True, True]]))
    (ls,) = s.layer_stats()
    assert ls.activation_prob == [0, 1.0, 0, 1.0]  # every token goes to both (top-2 of 2)


def test_hidden_means_per_expert():
    h = torch.tensor([[1.0, 0, 0, 0], [3.0, 0, 0, 0], [0, 2.0, 0, 0]])
    b = block_with([[.9, .1], [.8, .2], [.1, .9]], hidden=h)
    s = ActivationStats({2: b}, num_experts=4, hidden=True)
    s.add_train(torch.ones(1, 3, dtype=torch.bool), torch.tensor([0.5]), torch.tensor([True]))
    (ls,) = s.layer_stats()
    assert ls.hidden_mean[1] == [2.0, 0, 0, 0] and ls.hidden_mean[3] == [0, 2.0, 0, 0]
    assert ls.hidden_mean[0] is None
