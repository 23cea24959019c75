"""The real all-MiniLM-L6-v2 MoE learns on BBC News samples."""

import pytest
import torch

from moe_model.models import get_adapter
from moe_model.shards import decode_shard, encode_shard, shards_for, split_base
from moe_model.submoe import SubMoE
from moe_model.train import evaluate, train_local
from fedmoe.datasets import bbc_news
from protocol.messages import ModelSpec, TrainConfig


@pytest.mark.slow
def test_minilm_moe_loss_goes_down_on_bbc():
    torch.manual_seed(0)
    spec = ModelSpec(max_seq_len=48)
    ad = get_adapter(spec.family)
    experts = {layer: [0, 3, 5] for layer in ad.moe_layers(spec)}  # a sub-MoE, int8 base shards
    skel = ad.build(spec, {layer: list(range(8)) for layer in ad.moe_layers(spec)}, 5, device="meta")
    all_shards = split_base(ad.base_state(spec), skel)
    shards = {s: decode_shard(encode_shard(all_shards[s], "int8")) for s in shards_for(experts)}
    model = SubMoE(spec, experts, "bbc", 5, shards)
    items, labels = bbc_news()
    data = [(x, labels.index(y)) for x, y in items[::15]]  # 149 articles, all classes
    before = evaluate(model, data, batch_size=16)
    train_local(model, data, TrainConfig(max_steps=15, batch_size=8, lr=2e-3))
    after = evaluate(model, data, batch_size=16)
    assert after.loss < before.loss - 0.2, (before, after)
    assert after.accuracy > before.accuracy
