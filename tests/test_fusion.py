"""Fed-MoE server fusion (``cloud/strategies/fusion.py``; Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610 eq. 1-13):
the math against hand-computed values, the strategy on a tiny global model, the cloud-only
reserved set D^r, and a federation on the embedded broker."""

from __future__ import annotations

import math

import pytest
import torch

from cloud.global_model import GlobalModel
from cloud.service import StrategyConfig
from cloud.strategies import get_strategy
from cloud.strategies.fusion import (
    EXPERTS,
    SYNC_PREFIX,
    Fusion,
    gate_loss,
    gating_entropy,
    mixture_probs,
    relevance,
    row_softmax,
    sync_weights,
    synchronise_clients,
    top_l_mixture,
    true_label_probs,
    update_experts,
)
from cloud.strategy import ClientResult, DeviceView, Setup
from fedmoe.partition import partition, reserve
from fedmoe.simulate import SimulationConfig
from protocol.messages import Stats, TrainConfig
from tests.conftest import tiny_spec
from tests.federation import Federation

D = torch.float64


# --------------------------------------------------------------------------- the math, by hand
def test_true_label_probs_picks_each_models_probability_of_the_label():
    probs = torch.tensor([[[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]],     # model 1 on 3 samples
                          [[0.1, 0.9], [0.6, 0.4], [0.3, 0.7]]], dtype=D)  # model 2
    p_y = true_label_probs(probs, torch.tensor([0, 1, 1]))
    assert torch.allclose(p_y, torch.tensor([[0.7, 0.1], [0.8, 0.4], [0.5, 0.7]], dtype=D))
    with pytest.raises(ValueError):
        true_label_probs(probs, torch.tensor([0, 1]))


def test_w_w_r_and_w_c_match_hand_computed_values():
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=D)              # N=2 samples, K=2
    p_y = torch.tensor([[0.8, 0.2, 0.4], [0.6, 1.0, 0.0]], dtype=D)  # m=3 clients
    w = relevance(q, p_y)
    # W[0] = ((1)(.8,.2,.4) + (.5)(.6,1,0)) / 2 = (.55, .35, .2); W[1] = (.5)(.6,1,0)/2 = (.15, .25, 0)
    assert torch.allclose(w, torch.tensor([[0.55, 0.35, 0.20], [0.15, 0.25, 0.0]], dtype=D))
    w_r = row_softmax(w)
    e = [math.exp(x) for x in (0.55, 0.35, 0.20)]
    assert torch.allclose(w_r[0], torch.tensor([x / sum(e) for x in e], dtype=D))
    assert torch.allclose(w_r.sum(1), torch.ones(2, dtype=D))
    w_c = sync_weights(w, 0.4)                                       # cat(1-α, α·W): rows (.6,.6,.6), .4·W
    col0 = [math.exp(x) for x in (0.6, 0.4 * 0.55, 0.4 * 0.15)]
    col2 = [math.exp(x) for x in (0.6, 0.4 * 0.20, 0.0)]
    assert w_c.shape == (3, 3)
    assert torch.allclose(w_c[:, 0], torch.tensor([x / sum(col0) for x in col0], dtype=D))
    assert torch.allclose(w_c[:, 2], torch.tensor([x / sum(col2) for x in col2], dtype=D))
    assert torch.allclose(w_c.sum(0), torch.ones(3, dtype=D))


def test_lambda_updates_of_the_server_experts_and_the_clients():
    experts = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0]], dtype=D)   # E_0, E_1, E_2 (P=2)
    models = torch.tensor([[4.0, 0.0], [0.0, 2.0]], dtype=D)               # M_1, M_2
    w_r = torch.tensor([[1.0, 0.0], [0.25, 0.75]], dtype=D)
    out = update_experts(experts, models, w_r, 0.5)
    # E_0 = .5·0 + .5·mean(M) = (1, .5); E_1 = .5·(1,1) + .5·M_1 = (2.5, .5); E_2 = .5·(2,0) + .5·(1, 1.5)
    assert torch.allclose(out, torch.tensor([[1.0, 0.5], [2.5, 0.5], [1.5, 0.75]], dtype=D))
    w_c = torch.tensor([[0.5, 0.0], [0.5, 0.0], [0.0, 1.0]], dtype=D)      # (K+1) x m, columns sum to 1
    synced = synchronise_clients(models, experts, w_c, 0.25)
    # M_1 = .25·(4,0) + .75·(.5·E_0 + .5·E_1) = (1,0) + (.375,.375); M_2 = .25·(0,2) + .75·E_2 = (1.5, .5)
    assert torch.allclose(synced, torch.tensor([[1.375, 0.375], [1.5, 0.5]], dtype=D))


def test_mixture_and_top_l_inference():
    p0 = torch.tensor([[0.5, 0.5]], dtype=D)
    routed = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.2, 0.8]]], dtype=D)  # K=3, N=1
    q = torch.tensor([[0.6, 0.3, 0.1]], dtype=D)
    assert torch.allclose(mixture_probs(p0, routed, q, 0.5), torch.tensor([[0.5 * 0.5 + 0.5 * 0.62,
                                                                            0.5 * 0.5 + 0.5 * 0.38]], dtype=D))
    # L = 1: only expert 1 (gate .6), weight 1
    assert torch.allclose(top_l_mixture(p0, routed, q, 0.5, 1), torch.tensor([[0.75, 0.25]], dtype=D))
    # L = 2: softmax over the selected gate values (.6, .3), eq. 10
    s = torch.softmax(torch.tensor([0.6, 0.3], dtype=D), 0)
    expect = 0.5 * p0 + 0.5 * (s[0] * routed[0] + s[1] * routed[1])
    assert torch.allclose(top_l_mixture(p0, routed, q, 0.5, 2), expect)
    with pytest.raises(ValueError):
        top_l_mixture(p0, routed, q, 0.5, 4)


def test_the_entropy_term_is_positive_and_a_step_on_it_sharpens_the_gate():
    assert float(gating_entropy(torch.tensor([[0.5, 0.5]], dtype=D))) == pytest.approx(math.log(2))
    assert float(gating_entropy(torch.tensor([[1.0, 0.0]], dtype=D))) == pytest.approx(0.0, abs=1e-9)
    # routed experts that agree: the CE term does not care about Q, only β·H(Q) moves the gate
    p0, routed = torch.tensor([[0.5, 0.5]], dtype=D), torch.tensor([[[0.5, 0.5]], [[0.5, 0.5]]], dtype=D)
    logits = torch.tensor([[0.3, 0.1]], dtype=D, requires_grad=True)
    h0 = float(gating_entropy(torch.softmax(logits.detach(), 1)))
    gate_loss(p0, routed, torch.softmax(logits, 1), 0.5, torch.tensor([0]), beta=1.0).backward()
    with torch.no_grad():
        stepped = logits - 0.5 * logits.grad
    assert float(gating_entropy(torch.softmax(stepped, 1))) < h0     # minimising +β·H sharpens Q (Sec. 4.2)
    assert float(stepped[0, 0] - stepped[0, 1]) > 0.2                # the leading expert leads more


# --------------------------------------------------------------------------- D^r
def test_reserve_is_deterministic_disjoint_and_two_percent_by_default():
    idx = list(range(3, 1003))
    devices, kept = reserve(idx, 0.02, seed=7)
    assert len(kept) == 20 and not set(devices) & set(kept) and sorted(devices + kept) == idx
    assert reserve(idx, 0.02, seed=7) == (devices, kept) and reserve(idx, 0.02, seed=8)[1] != kept
    parts = partition([i % 5 for i in range(len(devices))], 4, "dirichlet:0.5", 0)
    assert not {devices[j] for p in parts for j in p} & set(kept)
    with pytest.raises(ValueError):
        reserve(idx, 0.0, 0)
    assert Fusion.reserve_fraction_of({}) == 0.02 and get_strategy("composed").reserve_fraction_of({}) == 0.0


def test_simulate_writes_a_reserved_split_disjoint_from_every_device(tmp_path):
    from edge_sdk.data import load_text_file
    from fedmoe.simulate import _prepare_data

    cfg = SimulationConfig(devices=3, tasks=["bbc"], budgets=[10**10] * 3, strategy="fusion",
                           max_samples_per_task=400)
    devices, tasks = _prepare_data(cfg, tmp_path)
    reserved = load_text_file(tasks["bbc"]["reserved_data"]).items
    held = {t for d in devices for t, _ in load_text_file(d["data"]).items}
    train = len(held) + len(reserved)
    assert len(reserved) == round(0.02 * 320) and not {t for t, _ in reserved} & held, train
    again, tasks2 = _prepare_data(cfg, tmp_path / "again")
    assert load_text_file(tasks2["bbc"]["reserved_data"]).items == reserved


def test_simulate_admits_a_device_that_fits_the_compact_model_only_with_a_smaller_batch():
    from fedmoe.simulate import SimulationConfigError, check_budgets
    from moe_model.budget import estimate
    from tests.conftest import TINY_CONFIG

    kw = dict(devices=1, budgets=["1GiB"], base=None, model_config=TINY_CONFIG, num_experts=4)
    spec = SimulationConfig(**kw).model
    budget = estimate(spec, 1, 1, 5, 400 * 2**20, "int8").total + 1             # < the plan at batch 8
    assert budget < estimate(spec, 1, 8, 5, 400 * 2**20, "int8").total
    devices = [{"device_id": "dev-00", "task": "bbc", "data": "-", "budget_bytes": budget}]
    with pytest.raises(SimulationConfigError):
        check_budgets(SimulationConfig(**kw), devices, baseline=400 * 2**20)
    check_budgets(SimulationConfig(**kw, strategy="fusion"), devices, baseline=400 * 2**20)


def test_small_devices_get_a_budget_below_one_expert_at_the_batch_size_but_above_it_at_half(monkeypatch):
    import fedmoe.sim_budgets as S
    from moe_model.budget import estimate

    monkeypatch.setattr(S, "device_baseline_bytes", lambda data=None: 400 * 2**20)
    cfg = SimulationConfig(devices=3, small_devices=1, budgets=["2GiB"], strategy="fusion_hybrid")
    budgets = S.device_budgets(cfg)
    plan = {b: estimate(cfg.model, 1, b, 5, 400 * 2**20, cfg.weight_format).total for b in (8, 4)}
    assert budgets[:2] == [2 * 2**30] * 2 and plan[4] < budgets[2] < plan[8]
    with pytest.raises(S.SimulationConfigError, match="more than --devices"):
        S.device_budgets(SimulationConfig(devices=2, small_devices=3, budgets=["2GiB"]))
    with pytest.raises(S.SimulationConfigError, match="batch size of at least 2"):
        S.device_budgets(SimulationConfig(devices=2, small_devices=1, budgets=["2GiB"], batch_size=1))


# --------------------------------------------------------------------------- the strategy on a tiny model
LONG = {"upcycle_noise": 0.01, "max_seq_len": 128}
"""A tiny model whose training step outweighs the plan's 16 MiB shard download window, so the
batch size changes what a device needs (at 32 tokens the window is the larger part)."""


def _model_and_strategy(spec_kw=None, **params):
    spec = tiny_spec(**(spec_kw or {}))
    model = GlobalModel(spec, {"t": ["a", "b"]}, "fp32")
    items = [(f"sample text number {i} about {'markets' if i % 2 else 'football'}", i % 2) for i in range(12)]
    setup = Setup(model.layers, spec.num_experts, 0, TrainConfig(batch_size=8), {"t": ["a", "b"]},
                  reserved={"t": items})
    return model, Fusion(setup, routed_experts=2, iterations=2, gate_steps=3, **params), items


def test_configuration_errors_are_clear():
    model, _, items = _model_and_strategy()
    setup = Setup(model.layers, 4, 0, TrainConfig(), {"t": ["a", "b"]})
    with pytest.raises(ValueError, match="server-reserved labelled set D\\^r for task 't'"):
        Fusion(setup)
    with pytest.raises(ValueError, match="one task"):
        Fusion(Setup(model.layers, 4, 0, TrainConfig(), {"t": ["a", "b"], "u": ["a", "b"]}, reserved={"t": items}))
    with pytest.raises(ValueError, match="top_l"):
        Fusion(Setup(model.layers, 4, 0, TrainConfig(), {"t": ["a", "b"]}, reserved={"t": items}), top_l=4)


def test_a_device_below_one_expert_per_layer_trains_the_compact_model_with_a_smaller_batch():
    from moe_model.budget import estimate

    model, s, _ = _model_and_strategy(LONG)
    need = {b: estimate(model.spec, 1, b, 2, 0, "fp32").total for b in (8, 4, 1)}
    views = [DeviceView("big", "t", 10, need[8] + 1, 1, extra={"runtime_bytes": 0, "weight_format": "fp32"}),
             DeviceView("small", "t", 10, need[4] + 1, 0, extra={"runtime_bytes": 0, "weight_format": "fp32"}),
             DeviceView("tiny", "t", 10, need[1] - 1, 0, extra={"runtime_bytes": 0, "weight_format": "fp32"})]
    plan = s.configure_round(1, views, model)
    assert plan.assignments == {"big": {1: [0]}, "small": {1: [0]}}
    assert plan.train == {"small": {"batch_size": 4}} and "no smaller model" in plan.excluded["tiny"]


def test_aggregate_fuses_into_the_server_moe_and_synchronises_each_client():
    model, s, _ = _model_and_strategy()
    compact = s.compact(model)
    base = model.state_for(compact, "t")
    results = []
    for j, d in enumerate(("d0", "d1")):
        gen = torch.Generator().manual_seed(j)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        stats = Stats.model_construct(device_id=d, round=1, num_samples=10)
        results.append(ClientResult(d, "t", 10, compact, state, stats))
    ev0 = s.evaluate(0, model, {"t": [("football match", 0), ("stock markets", 1)]})
    assert ev0["per_task"]["t"]["samples"] == 2
    out = s.aggregate(1, model, results, [])
    experts = out.owned[EXPERTS]
    assert experts.shape[0] == 3 and not torch.equal(experts[1], experts[2])   # routed experts diverged
    mean = torch.stack([s.flatten(r.state, model) for r in results]).mean(0)
    e0 = s.flatten(base, model)
    expect_e0 = (0.5 ** 2) * e0 + (1 - 0.5 ** 2) * mean                         # eq. 6 applied T=2 times
    assert torch.allclose(experts[0].double(), expect_e0, atol=1e-5)
    assert torch.allclose(s.flatten(out.state, model), experts[0].double(), atol=1e-6)  # global = E_0
    model.set_state(out.state)
    model.set_owned(out.owned)
    sent = {d: s.state_for(d, "t", compact, model) for d in ("d0", "d1", "new")}
    assert torch.allclose(s.flatten(sent["d0"], model), out.owned[SYNC_PREFIX + "d0"].double())
    assert not torch.allclose(s.flatten(sent["d0"], model), s.flatten(sent["d1"], model))
    assert torch.allclose(s.flatten(sent["new"], model), experts[0].double())  # a new device starts from E_0
    assert set(sent["d0"]) == set(model.state_for(compact, "t"))
    w_c = torch.tensor(out.metrics["W_c"])
    assert torch.allclose(w_c.sum(0), torch.ones(2, dtype=w_c.dtype), atol=1e-6)
    assert 0 < out.metrics["alpha"] < 1 and s.evaluate(1, model, {"t": [("football", 0)]})["accuracy"] is not None


# --------------------------------------------------------------------------- a federation on the embedded broker
@pytest.mark.slow
def test_a_fusion_federation_runs_two_rounds_each_device_gets_its_own_model_and_d_r_stays_home(
        embedded_url, tmp_path, monkeypatch):
    import paho.mqtt.client as mqtt

    from fedmoe.datasets import bbc_news

    items, _ = bbc_news()
    reserved = [items[i] for i in range(2, len(items), 7) if i % 40][:24]
    published: list[tuple[str, bytes]] = []
    real = mqtt.Client.publish

    def spy(self, topic, payload=None, *a, **kw):
        published.append((topic, bytes(payload or b"")))
        return real(self, topic, payload, *a, **kw)

    monkeypatch.setattr(mqtt.Client, "publish", spy)
    fed = Federation(embedded_url, str(tmp_path), experts=(1, 0), reserved=reserved, spec_kw=LONG,
                     config_kw={"strategy": StrategyConfig(name="fusion", params={
                         "routed_experts": 2, "iterations": 2, "gate_steps": 3})})
    held = {t for i in range(2) for t, _ in fed.train_items[i * 40:(i + 1) * 40]}
    assert not held & {t for t, _ in reserved}
    engine, sent, aggregated = fed.aggregator.engine, [], []
    real_sent, real_agg = engine._sent_state, engine.strategy.aggregate

    def record_sent(device_id, experts):
        state = real_sent(device_id, experts)
        sent.append((engine.current.number, device_id, state))
        return state

    def record_agg(*a, **kw):
        out = real_agg(*a, **kw)
        aggregated.append(out)
        return out

    monkeypatch.setattr(engine, "_sent_state", record_sent)
    monkeypatch.setattr(engine.strategy, "aggregate", record_agg)
    records = fed.run(timeout=240)
    assert [r["status"] for r in records] == ["ok", "ok"], records
    assert all(sorted(r["selected"]) == ["dev0", "dev1"] for r in records)     # dev1 holds 0 experts per layer
    assert records[0]["assignment"].get("smaller_batch", {}).get("dev1", 8) < 8
    assert all("dev1" not in r["excluded"] for r in records)                 # not told it is excluded
    assert records[1]["accuracy"] is not None and "W_c" in records[1]["strategy_metrics"]
    s, model = engine.strategy, fed.aggregator.model
    synced = aggregated[0].owned
    round2 = {d: st for n, d, st in sent if n == 2}
    assert set(round2) == {"dev0", "dev1"}
    for d in ("dev0", "dev1"):                                                  # its own synchronised model
        assert torch.allclose(s.flatten(round2[d], model), synced[SYNC_PREFIX + d].double())
    assert not torch.allclose(s.flatten(round2["dev0"], model), s.flatten(round2["dev1"], model))
    downs = [p for t, p in published if "/down/" in t or "/shards/" in t]
    assert any(b"safetensors" in p or len(p) > 1000 for p in downs) and len(published) > 20
    texts = [t.encode() for t, _ in reserved]
    leaks = [(t, x[:40]) for t, p in published for x in texts if x in p]
    assert not leaks, leaks


# --------------------------------------------------------------------------- the hybrid
def _hybrid(**params):
    from cloud.strategies.fusion_hybrid import FusionHybrid

    spec = tiny_spec()
    model = GlobalModel(spec, {"t": ["a", "b"]}, "fp32")
    items = [(f"sample text number {i} about {'markets' if i % 2 else 'football'}", i % 2) for i in range(12)]
    setup = Setup(model.layers, spec.num_experts, 0, TrainConfig(batch_size=8), {"t": ["a", "b"]},
                  reserved={"t": items})
    return model, FusionHybrid(setup, iterations=2, gate_steps=3, **params)


def _result(model, d, experts, n, seed):
    base = model.state_for(experts, "t")
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    return ClientResult(d, "t", n, experts, state, Stats.model_construct(device_id=d, round=1, num_samples=n))


def test_hybrid_splits_devices_by_capacity_and_aggregates_what_is_shared_with_what():
    from cloud.strategies.fusion_hybrid import slot_key

    model, s = _hybrid()
    assert s.k == 3 and slot_key("expert.1.0.fc1.lora_B", 2) == "expert.1.2.fc1.lora_B"
    views = [DeviceView(d, "t", 10, 10**12, cap, extra={"runtime_bytes": 0, "weight_format": "fp32"})
             for d, cap in (("big", 4), ("mid", 2), ("one", 1), ("zero", 0))]
    plan = s.configure_round(1, views, model)
    assert s.compact_devices == {"one", "zero"} and plan.info["compact"] == ["one", "zero"]
    assert plan.assignments["one"] == plan.assignments["zero"] == {1: [0]}
    assert len(plan.assignments["big"][1]) == 4 and len(plan.assignments["mid"][1]) == 2
    s.compact_devices = {"c0", "c1"}
    results = [_result(model, "a", {1: [0, 1]}, 30, 1), _result(model, "b", {1: [2, 3]}, 10, 2),
               _result(model, "c0", {1: [0]}, 10, 3), _result(model, "c1", {1: [0]}, 10, 4)]
    out = s.aggregate(1, model, results, [])
    st, n = out.state, {"a": 30, "b": 10, "c0": 10, "c1": 10}
    for k in model.state:                                          # backbone and head: FedAvg over all four
        if keys_group(k) in ("backbone", "head"):
            expect = sum(n[r.device_id] * r.state[k].double() for r in results) / 60
            assert torch.allclose(st[k].double(), expect, atol=1e-6), k
    assert torch.equal(st["router.1.0"], results[0].state["router.1.0"])   # router rows: sub-MoE holders only
    lam = 0.5 * 20 / 60
    assert out.metrics["lambda_step3"] == pytest.approx(lam)
    k0 = next(k for k in model.state if k.startswith("expert.1.0."))        # slot 0 = E_0: eq. 6 twice
    mean_c = (results[2].state[k0].double() + results[3].state[k0].double()) / 2
    expect = (1 - lam) ** 2 * results[0].state[k0].double() + (1 - (1 - lam) ** 2) * mean_c
    assert torch.allclose(st[k0].double(), expect, atol=1e-6)
    k3 = k0.replace("expert.1.0.", "expert.1.3.")                            # a routed slot moved by W^r
    assert not torch.allclose(st[k3], results[1].state[k3])
    sent = s.state_for("c0", "t", {1: [0]}, _committed(model, out))
    assert torch.allclose(s.flatten(sent, model), out.owned[SYNC_PREFIX + "c0"].double())
    assert set(s.state_for("a", "t", {1: [0, 1]}, model)) == set(model.state_for({1: [0, 1]}, "t"))
    ev = s.evaluate(1, model, {"t": [("football", 0), ("markets", 1)]})
    assert ev["accuracy"] is not None and ev["fused"]["accuracy"] is not None


def test_hybrid_without_compact_devices_is_the_aggregation_part():
    from cloud.aggregation.modular import Modular

    model, s = _hybrid()
    results = [_result(model, "a", {1: [0, 1]}, 30, 1), _result(model, "b", {1: [2, 3]}, 10, 2)]
    out = s.aggregate(1, model, results, [])
    expect = Modular().aggregate(1, model.state, results, [])
    assert all(torch.equal(out.state[k], expect[k]) for k in expect) and out.owned is None
    with pytest.raises(ValueError, match="routed_experts must be 3"):
        _hybrid(routed_experts=2)


def keys_group(name: str) -> str:
    from protocol import keys

    return keys.parse(name).group


def _committed(model, out):
    model.set_state(out.state)
    model.set_owned(out.owned)
    return model


@pytest.mark.slow
def test_a_hybrid_federation_trains_a_sub_moe_and_a_compact_device_together(embedded_url, tmp_path):
    from fedmoe.datasets import bbc_news

    items, _ = bbc_news()
    reserved = [items[i] for i in range(2, len(items), 7) if i % 40][:24]
    fed = Federation(embedded_url, str(tmp_path), experts=(2, 0), reserved=reserved, spec_kw=LONG,
                     config_kw={"strategy": StrategyConfig(name="fusion_hybrid", params={
                         "iterations": 2, "gate_steps": 3})})
    records = fed.run(timeout=240)
    assert [r["status"] for r in records] == ["ok", "ok"], records
    for r in records:
        assert sorted(r["selected"]) == ["dev0", "dev1"] and r["assignment"]["compact"] == ["dev1"]
        m = r["strategy_metrics"]
        assert m["compact_clients"] == 1 and m["sub_moe_clients"] == 1 and 0 < m["lambda_step3"] < 0.5
    s = fed.aggregator.engine.strategy
    assert s.compact_devices == {"dev1"} and SYNC_PREFIX + "dev1" in fed.aggregator.model.owned


def test_the_aggregator_loads_d_r_from_its_config_file_and_checks_the_path(tmp_path):
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from edge_sdk.data import write_jsonl

    path = tmp_path / "reserved.jsonl"
    write_jsonl(path, [("stocks fell", "b"), ("the match ended", "a"), ("rates rose", "b")])
    kw = dict(federation="fu", model=tiny_spec(), store=f"sqlite:///{tmp_path}/agg.db",
              strategy=StrategyConfig(name="fusion"))
    nowhere = str(tmp_path / "no")
    missing = AggregatorConfig(tasks={"bbc": TaskConfig(labels=["a", "b"], reserved_data=nowhere)}, **kw)
    with pytest.raises(ValueError, match="tasks.bbc.reserved_data: no such file"):
        missing.check_paths()
    cfg = AggregatorConfig(tasks={"bbc": TaskConfig(labels=["a", "b"], reserved_data=str(path))}, **kw)
    agg = Aggregator(cfg, "mqtt://127.0.0.1:1")
    try:
        assert agg.engine.strategy.reserved == [("stocks fell", 1), ("the match ended", 0), ("rates rose", 1)]
        assert "bbc" not in agg.eval_data                      # D^r is not the test set either
    finally:
        agg.store.close()
    with pytest.raises(ValueError, match="D\\^r for task 'bbc'"):
        Aggregator(AggregatorConfig(tasks={"bbc": TaskConfig(labels=["a", "b"])}, **kw), "mqtt://127.0.0.1:1")
