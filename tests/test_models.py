"""Upcycling equivalence, shards, the sub-MoE and its adapter state."""

import pytest
import torch
from transformers import BertModel

from moe_model.models import all_experts, get_adapter
from moe_model.models.bert_upcycled import resolve_path
from moe_model.shards import BACKBONE, decode_shard, encode_shard, join_shards, shards_for, split_base
from moe_model.submoe import SubMoE
from protocol import keys
from tests.conftest import tiny_spec


def shards(spec, fmt="fp32"):
    ad = get_adapter(spec.family)
    skel = ad.build(spec, all_experts(ad, spec), 2, device="meta")
    return {k: decode_shard(encode_shard(v, fmt)) for k, v in split_base(ad.base_state(spec), skel).items()}


def dense_forward(spec, batch):
    """Mean-pooled hidden states of the dense (not upcycled) encoder with the same weights."""
    ad = get_adapter(spec.family)
    cfg = ad.config(spec)
    if spec.base is None:
        torch.manual_seed(spec.seed)
        dense = BertModel(cfg, add_pooling_layer=False)
    else:
        dense = BertModel.from_pretrained(resolve_path(spec.base), config=cfg, add_pooling_layer=False)
    dense.eval()
    h = dense(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    return (h * m).sum(1) / m.sum(1)


def moe_pooled(model, batch):
    model.eval()
    hidden = model.model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden * m).sum(1) / m.sum(1)


TEXTS = [("The quick brown fox jumps over the lazy dog.", 0), ("Shares rose sharply after strong results.", 1),
         ("The striker scored twice in the second half", 0)]


@torch.no_grad()
def test_upcycled_equals_dense_tiny():
    spec = tiny_spec(upcycle_noise=0.0)
    model = SubMoE(spec, {1: [0, 1, 2, 3]}, "t", 2, shards(spec))
    batch, _ = model.collate(TEXTS)
    assert torch.allclose(moe_pooled(model, batch), dense_forward(spec, batch), atol=1e-5)
    # a sub-MoE of any expert subset computes the same function before training
    sub = SubMoE(spec, {1: [2]}, "t", 2, shards(spec))
    assert torch.allclose(moe_pooled(sub, batch), dense_forward(spec, batch), atol=1e-5)


@pytest.mark.slow
@torch.no_grad()
def test_upcycled_minilm_equals_dense():
    from protocol.messages import ModelSpec

    spec = ModelSpec(upcycle_noise=0.0, max_seq_len=64)
    model = SubMoE(spec, all_experts(get_adapter(spec.family), spec), "t", 5, shards(spec))
    batch, _ = model.collate(TEXTS)
    assert torch.allclose(moe_pooled(model, batch), dense_forward(spec, batch), atol=1e-4)
    # with the default symmetry-breaking noise the function stays (almost) the same
    noisy_spec = ModelSpec(max_seq_len=64)
    noisy = SubMoE(noisy_spec, all_experts(get_adapter(spec.family), spec), "t", 5, shards(noisy_spec))
    cos = torch.nn.functional.cosine_similarity(moe_pooled(noisy, batch), dense_forward(spec, batch))
    assert cos.min() > 0.999


def test_shards_split_and_join_cover_everything():
    spec = tiny_spec()
    ad = get_adapter(spec.family)
    skel = ad.build(spec, all_experts(ad, spec), 2, device="meta")
    base = ad.base_state(spec)
    sh = split_base(base, skel)
    assert set(sh) == {BACKBONE, "L1.E0", "L1.E1", "L1.E2", "L1.E3"}
    assert set(sh["L1.E2"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    joined = join_shards(skel, sh)
    assert set(joined) == set(base)
    sub = ad.build(spec, {1: [1, 3]}, 2, device="meta")
    assert shards_for({1: [3, 1]}) == [BACKBONE, "L1.E1", "L1.E3"]
    with pytest.raises(KeyError, match="L1.E3"):
        join_shards(sub, {k: v for k, v in sh.items() if k != "L1.E3"})


def test_submoe_holds_only_assigned_experts_with_global_keys():
    spec = tiny_spec()
    sh = shards(spec)
    model = SubMoE(spec, {1: [1, 3]}, "bbc", 5, {k: sh[k] for k in shards_for({1: [1, 3]})})
    state = model.adapter_state()
    groups = {keys.parse(k).group for k in state}
    assert groups == {"expert", "router", "head", "backbone"}
    assert {keys.parse(k).expert for k in state if keys.parse(k).group == "expert"} == {1, 3}
    assert set(k for k in state if k.startswith("router.")) == {"router.1.1", "router.1.3"}
    assert all(".lora_A" not in k for k in state)  # FFA-LoRA: A is frozen and not shipped
    assert all(".lora_B" in k for k in state if k.startswith(("expert", "backbone")))
    batch, labels = model.collate(TEXTS)
    assert model(batch).shape == (3, 5)
    # only adapter-state parameters train
    trainable = {id(p) for p in model.trainable().values()}
    assert all((id(p) in trainable) == p.requires_grad for p in model.parameters())


def test_lora_a_and_initial_state_identical_across_builds():
    spec = tiny_spec()
    sh = shards(spec)
    a = SubMoE(spec, {1: [0, 1, 2, 3]}, "bbc", 5, sh)
    b = SubMoE(spec, {1: [2]}, "bbc", 5, {k: sh[k] for k in shards_for({1: [2]})})
    la = {n: p for n, p in a.model.named_parameters() if "experts.2.fc1.lora_A" in n}
    lb = {n: p for n, p in b.model.named_parameters() if "experts.2.fc1.lora_A" in n}
    assert la and torch.equal(next(iter(la.values())), next(iter(lb.values())))
    sa, sb = a.adapter_state(), b.adapter_state()
    for k, v in sb.items():
        assert torch.equal(sa[k], v), k


def test_trained_lora_a_starts_from_its_seeded_draw_and_learns():
    """``lora.train_a``: A is adapter state, starts from the same seeded draw as frozen A
    (not 0: with A = B = 0 no gradient ever reaches either) and moves in training."""
    from moe_model.train import train_local
    from protocol.messages import LoraSpec, TrainConfig

    ffa, both = (tiny_spec(lora=LoraSpec(train_a=t)) for t in (False, True))
    sh = shards(ffa)
    frozen = SubMoE(ffa, {1: [0, 1, 2, 3]}, "bbc", 2, sh)
    model = SubMoE(both, {1: [0, 1, 2, 3]}, "bbc", 2, sh)
    a_keys = [k for k in model.trainable() if ".lora_A" in k]
    assert a_keys and not any(".lora_A" in k for k in frozen.trainable())
    drawn = {n: p for n, p in frozen.model.named_parameters() if ".lora_A." in n}
    for n, p in model.model.named_parameters():
        if ".lora_A." in n:
            assert p.abs().sum() > 0 and torch.equal(p, drawn[n]), n
    before = model.adapter_state()
    train_local(model, TEXTS, TrainConfig(local_epochs=2, batch_size=3, lr=1e-2))
    after = model.adapter_state()
    assert any(not torch.equal(before[k], after[k]) for k in a_keys)


def test_adapter_state_load_validates():
    spec = tiny_spec()
    model = SubMoE(spec, {1: [0, 1]}, "bbc", 5, None)
    st = model.adapter_state()
    st["router.1.0"] = torch.ones_like(st["router.1.0"])
    model.load_adapter_state(st)
    assert torch.equal(model.adapter_state()["router.1.0"], st["router.1.0"])
    with pytest.raises(KeyError):
        model.load_adapter_state({k: v for k, v in st.items() if k != "router.1.0"})
    bad = dict(st)
    bad["router.1.0"] = torch.ones(7)
    with pytest.raises(ValueError):
        model.load_adapter_state(bad)


def test_moe_block_routes_top_k_over_held_experts_only():
    spec = tiny_spec()
    model = SubMoE(spec, {1: [0, 2, 3]}, "bbc", 5, None)
    block = model.model.moe_blocks()[1]
    batch, _ = model.collate(TEXTS)
    model(batch)
    rec = block.last
    assert rec.probs.shape[1] == 3 and rec.topk_idx.shape[1] == 2
    assert torch.allclose(rec.topk_weight.sum(-1), torch.ones(rec.topk_weight.shape[0]))


def test_capacity_dispatch_drops_the_lowest_gates_beyond_an_experts_capacity():
    """Under a capacity factor each held expert runs on its ``ceil(c·N·k/n)`` tokens of largest
    gate: at a capacity of every token the output is the exact dispatch's; below it, equal to
    the exact sum with each expert's routed tokens beyond its capacity (lowest gates) left out."""
    import math

    from moe_model.models.moe import MoELayer

    spec = tiny_spec()
    model = SubMoE(spec, {1: [0, 1, 2, 3]}, "bbc", 5, None).eval()
    block = model.model.moe_blocks()[1]
    torch.manual_seed(0)
    flat = torch.randn(40, spec.config["hidden_size"])
    probs = torch.softmax(torch.randn(40, 4), -1)
    weight, idx = probs.topk(2, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    exact = block.dispatch(flat, idx, weight, probs)
    block.capacity_factor = 2.0  # n / k: a capacity of every token
    assert block.capacity(40, 2) is None
    assert torch.equal(block.dispatch(flat, idx, weight, probs), exact)
    block.capacity_factor = 0.5
    cap = block.capacity(40, 2)
    assert cap == math.ceil(0.5 * 40 * 2 / 4) == 10
    got = block.dispatch(flat, idx, weight, probs)
    want, dropped = torch.zeros_like(flat), 0
    for j, e in enumerate(block.expert_ids):
        tok, slot = (idx == j).nonzero(as_tuple=True)
        g = weight[tok, slot]
        keep = g.argsort(descending=True)[:cap]
        dropped += len(tok) - len(keep)
        want.index_add_(0, tok[keep], block.experts[str(e)](flat[tok[keep]]) * g[keep, None])
    assert dropped > 0 and not torch.allclose(got, exact, atol=1e-4)
    assert torch.allclose(got, want, atol=1e-5)
    assert isinstance(block, MoELayer) and block.last.topk_idx is idx  # the record keeps every decision
    block.capacity_factor = None


def test_local_training_logs_its_progress_rate_limited(caplog):
    """A device is not silent while it trains: one line per ``log_every_s`` with the step,
    the loss and the seconds elapsed; none at all when training is shorter than that."""
    import logging

    from moe_model.train import train_local
    from protocol.messages import TrainConfig

    spec = tiny_spec()
    model = SubMoE(spec, {1: [0, 1]}, "bbc", 2, shards(spec))
    cfg = TrainConfig(local_epochs=10, max_steps=4, batch_size=2, lr=1e-3)
    with caplog.at_level(logging.INFO, logger="moe_model.train"):
        train_local(model, TEXTS, cfg, name="dev-1 round 3", log_every_s=0.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_model.train"]
    assert [line.split(", loss ")[0] for line in lines] == [f"dev-1 round 3: step {s}/4" for s in (1, 2, 3)]
    assert all(line.endswith(" s") for line in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moe_model.train"):
        train_local(model, TEXTS, cfg, name="dev-1 round 4", log_every_s=3600.0)
    assert not [r for r in caplog.records if r.name == "moe_model.train"]
