"""FedAlign-MoE (Fang et al. 2026, "Aggregation Alignment for Federated Learning with Mixture-of-Experts under Data Heterogeneity" (FedAlign-MoE), arXiv:2603.21276; docs/methods/fedalign-moe.md): each equation on hand-made
tensors, the device regulariser's gradient, the strategy's bounds on what devices report,
and a federation on the embedded broker."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cloud.service import StrategyConfig
from cloud.strategies import get_strategy
from cloud.strategies.fedalign import FedAlign, client_weights, global_routing
from cloud.strategy import ClientResult, Setup
from edge_sdk.objectives import terms_for
from edge_sdk.objectives.fedalign_align import RG_TENSOR, adaptive_weights, alignment_loss
from protocol.messages import BlobRef, LayerStats, Objective, Stats, TrainConfig
from tests.conftest import tiny_spec
from tests.federation import Federation
from tests.test_bounds import _hello, _offline, _send, _stats, _upload

E, H = 4, 3


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --------------------------------------------------------------------------- eq. 4-7: global routing distribution


def test_global_routing_weights_clients_by_overlap_times_margin():
    prev = torch.tensor([0.5, 0.5])
    r = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    m = torch.tensor([[0.4, 0.1], [0.2, 0.3]])
    held = torch.ones(2, 2, dtype=torch.bool)
    out = global_routing(prev, r, m, held, torch.tensor([1.0, 1.0]))
    # w = r * prev * M: A [.16, .01], B [.04, .09]; e0 = (.16*.8 + .04*.4)/.2 = .72, e1 = (.01*.2 + .09*.6)/.1 = .56
    assert out.tolist() == pytest.approx([0.72 / 1.28, 0.56 / 1.28])
    # the ablation: the unweighted mean of the r_c
    assert global_routing(prev, r, m, held, torch.ones(2), weighted=False).tolist() == pytest.approx([0.6, 0.4])


def test_global_routing_falls_back_to_the_sample_weighted_mean_where_weights_are_zero():
    r = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    out = global_routing(torch.tensor([0.5, 0.5]), r, torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool),
                         torch.tensor([30.0, 10.0]))
    assert out.tolist() == pytest.approx([(30 * .8 + 10 * .4) / 40, (30 * .2 + 10 * .6) / 40])


def test_global_routing_counts_only_holders_keeps_unheld_experts_and_sums_to_one():
    prev = torch.tensor([0.2, 0.3, 0.5])
    r = torch.tensor([[0.5, 0.5, 0.0]])
    m = torch.tensor([[0.1, 0.1, 0.0]])
    held = torch.tensor([[True, True, False]])
    out = global_routing(prev, r, m, held, torch.tensor([5.0]))
    assert out.tolist() == pytest.approx([0.5 / 1.5, 0.5 / 1.5, 0.5 / 1.5])   # e2 kept 0.5, then renormalised
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rr = torch.rand(5, E, generator=g)
        rr = rr / rr.sum(1, keepdim=True)
        out = global_routing(torch.full((E,), 1 / E), rr, torch.rand(5, E, generator=g),
                             torch.rand(5, E, generator=g) > 0.3, torch.rand(5, generator=g) * 10)
        assert float(out.sum()) == pytest.approx(1.0) and bool((out >= 0).all())


# --------------------------------------------------------------------------- eq. 13-18: semantic aggregation weights


def test_orthogonal_input_regions_close_the_gate():
    same = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    orthogonal = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    w = client_weights(same, orthogonal, threshold=0.5)        # s = 0 < s* = 0.5
    assert w.tolist() == pytest.approx([_sig(-0.5 / 0.05)] * 2) and float(w.max()) < 1e-4
    assert client_weights(same, same.clone(), threshold=0.5).tolist() == pytest.approx([_sig(0.5 / 0.05)] * 2)
    # two participants: sigma = 0, so s* = s and the adaptive gate is sigmoid(0) whatever s is
    assert client_weights(same, orthogonal).tolist() == pytest.approx([0.5, 0.5])


def test_adaptive_threshold_on_three_clients_by_hand():
    deltas = torch.ones(3, 5)
    h = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])     # s_AB = 1, s_AC = s_BC = 0
    mu, sd = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)
    s_star = mu - 1.0 * sd
    ab, ac = _sig((1 - s_star) / 0.05), _sig((0 - s_star) / 0.05)
    assert client_weights(deltas, h).tolist() == pytest.approx([ab + ac, ab + ac, 2 * ac])
    zeta2 = _sig((0 - (mu - 2 * sd)) / 0.05)
    assert client_weights(deltas, h, zeta=2.0)[2] == pytest.approx(2 * zeta2)


def test_identical_updates_get_equal_weights_and_direction_consensus_scales_them():
    h = torch.tensor([[1.0, 0.2], [0.9, 0.1], [1.0, 0.3]])
    w = client_weights(torch.ones(3, 4), h, threshold=-1.0)
    assert w.tolist() == pytest.approx([w[0].item()] * 3)
    d = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0]])    # cos: AB = .707, AC = -1 -> 0, BC = -.707 -> 0
    w = client_weights(d, torch.ones(3, 2), threshold=-1.0)
    g = _sig(2.0 / 0.05)
    assert w.tolist() == pytest.approx([g * math.sqrt(0.5), g * math.sqrt(0.5), 0.0])
    assert client_weights(d, torch.ones(3, 2), threshold=-1.0, consensus=False).tolist() == pytest.approx([2 * g] * 3)


def test_a_lone_participant_gets_weight_one():
    assert client_weights(torch.zeros(1, 7), torch.zeros(1, 3)).tolist() == [1.0]


# --------------------------------------------------------------------------- the strategy's aggregation


def _layer(held: dict[int, float], hidden: dict[int, list[float]] | None = None, tokens: int = 10,
           margin: float = 0.2) -> LayerStats:
    usage = [5 if e in held else 0 for e in range(E)]
    return LayerStats(layer=1, tokens=tokens, usage=usage, activation_prob=[0.0] * E,
                      routing_dist=[held.get(e, 0.0) for e in range(E)],
                      margin=[margin if e in held else 0.0 for e in range(E)],
                      expert_loss=[None] * E, expert_acc=[None] * E, expert_samples=[0] * E,
                      hidden_mean=None if hidden is None else [hidden.get(e) for e in range(E)])


def _device_stats(layer: LayerStats, n: int = 10, **kw) -> Stats:
    return Stats(device_id="d", round=1, task="t", num_samples=n, train_loss=0.5, layers=[layer],
                 update=BlobRef(transfer_id="u", bytes=1, sha256="0" * 64, chunks=1), train_seconds=1.0,
                 bytes_up=1, bytes_down=1, peak_rss_bytes=1, baseline_rss_bytes=0, shards_fetched=[], **kw)


def _strategy(**params) -> FedAlign:
    return get_strategy("fedalign")(Setup([1], E, 0, TrainConfig(), {"t": ["a", "b"]}, ("random_kept", {}),
                                          ("modular", {})), **params)


def _global() -> SimpleNamespace:
    state = {f"expert.1.{e}.fc1.lora_B": torch.zeros(2, 2) for e in range(E)}
    state |= {f"router.1.{e}": torch.zeros(H) for e in range(E)} | {"backbone.q.lora_B": torch.zeros(2)}
    return SimpleNamespace(state=state, owned={}, layers=[1])


def _result(name: str, experts: list[int], value: dict[int, float], routing: dict[int, float],
            hidden: dict[int, list[float]], n: int = 10, backbone: float = 0.0) -> ClientResult:
    state = {f"expert.1.{e}.fc1.lora_B": torch.full((2, 2), value.get(e, 0.0)) for e in experts}
    state |= {f"router.1.{e}": torch.full((H,), value.get(e, 0.0)) for e in experts}
    state["backbone.q.lora_B"] = torch.full((2,), backbone)
    return ClientResult(name, "t", n, {1: experts}, state, _device_stats(_layer(routing, hidden), n))


def test_aggregate_experts_semantically_routers_and_backbone_by_fedavg_and_updates_r_g():
    s, model = _strategy(), _global()
    a = _result("a", [0, 1, 2], {0: 1.0, 1: 1.0, 2: 0.5}, {0: .5, 1: .3, 2: .2},
                {0: [1, 0, 0], 1: [1, 0, 0], 2: [1, 0, 0]}, n=10, backbone=1.0)
    b = _result("b", [0, 1], {0: 1.0, 1: -1.0}, {0: .6, 1: .4}, {0: [1, 0, 0], 1: [1, 0, 0]}, n=30, backbone=3.0)
    out = s.aggregate(1, model, [a, b], [])
    st = out.state
    assert torch.allclose(st["expert.1.0.fc1.lora_B"], torch.ones(2, 2))       # equal weights, same update
    assert torch.equal(st["expert.1.1.fc1.lora_B"], torch.zeros(2, 2))         # opposite updates: all omega 0
    assert torch.allclose(st["expert.1.2.fc1.lora_B"], torch.full((2, 2), 0.5))  # lone holder taken as is
    assert torch.equal(st["expert.1.3.fc1.lora_B"], torch.zeros(2, 2))         # nobody held it
    assert torch.allclose(st["router.1.1"], torch.full((H,), (10 - 30) / 40))  # router rows: FedAvg of holders
    assert torch.allclose(st["backbone.q.lora_B"], torch.full((2,), (10 + 90) / 40))
    assert out.metrics["experts"] == {"aggregated": 2, "unchanged": 2}
    r_g = out.owned[RG_TENSOR]
    assert r_g.shape == (1, E) and float(r_g.sum()) == pytest.approx(1.0)
    prev = torch.full((E,), 1 / E)
    rows = torch.tensor([[.5, .3, .2, 0], [.6, .4, 0, 0]])
    expect = global_routing(prev, rows, (rows > 0) * 0.2, rows > 0, torch.tensor([10.0, 30.0]))
    assert r_g[0].tolist() == pytest.approx(expect.tolist(), abs=1e-6)
    plain = _strategy(semantic_aggregation=False).aggregate(1, model, [a, b], [])
    assert torch.allclose(plain.state["expert.1.1.fc1.lora_B"], torch.full((2, 2), -0.5))  # FedAvg by |D_c|


def test_a_holder_that_routed_nothing_to_an_expert_does_not_count_for_it():
    s, model = _strategy(), _global()
    a = _result("a", [0, 1], {0: 2.0}, {0: 1.0}, {0: [1, 0, 0]})
    b = _result("b", [0, 1], {1: 1.0}, {1: 1.0}, {1: [0, 1, 0]})
    st = s.aggregate(1, model, [a, b], []).state
    assert torch.allclose(st["expert.1.0.fc1.lora_B"], torch.full((2, 2), 2.0))
    assert torch.allclose(st["expert.1.1.fc1.lora_B"], torch.full((2, 2), 1.0))


# --------------------------------------------------------------------------- stats_problem


def test_stats_problem_bounds_what_fedalign_reads():
    s = _strategy()
    s.hidden = {1: H}
    good = _layer({0: .5, 2: .5}, {0: [0.1] * H, 2: [0.2] * H})
    assert s.stats_problem("d", _device_stats(good)) is None
    assert s.stats_problem("d", _device_stats(_layer({}, {}, tokens=0))) is None   # no tokens: all zero
    bad = {
        "sums to": _layer({0: .5, 2: .4}, {0: [0.1] * H, 2: [0.2] * H}),
        "no usage": good.model_copy(update={"routing_dist": [.5, 0.0, .5, 0.0], "margin": [.2, .1, .2, 0.0]}),
        "finite": good.model_copy(update={"routing_dist": [float("nan"), 0.0, .5, 0.0]}),
        "size 3": _layer({0: .5, 2: .5}, {0: [0.1] * H, 2: [0.2] * (H + 1)}),
        "hidden_mean": _layer({0: .5, 2: .5}, None),
        "vector": good.model_copy(update={"hidden_mean": [[0.1] * H, None, [float("inf")] * H, None]}),
        "entries": good.model_copy(update={"routing_dist": [.5, .5], "margin": [0.0, 0.0]}),
    }
    for why, layer in bad.items():   # as a lying device could send them (the schema catches some first)
        problem = s.stats_problem("d", _device_stats(good).model_copy(update={"layers": [layer]}))
        assert problem and problem.startswith("fedalign") and why in problem, (why, problem)
    wrong_layer = _device_stats(good.model_copy(update={"layer": 3}))
    assert "differ" in s.stats_problem("d", wrong_layer)
    assert _strategy(router_alignment=False, semantic_aggregation=False).stats_problem(
        "d", _device_stats(_layer({0: .5, 2: .5}, None))) is None                # not asked for hidden states


def test_invalid_parameters_are_refused():
    for bad in ({"mu": -1}, {"t_s": 0}, {"zeta": "x"}, {"threshold": 2.0}, {"adaptive_lambda": 1}, {"tau_o": True}):
        with pytest.raises(ValueError, match="fedalign: invalid"):
            _strategy(**bad)
    with pytest.raises(TypeError, match="unknown"):
        _strategy(nope=1)


# --------------------------------------------------------------------------- eq. 8-11: the device term


def test_adaptive_lambda_is_monotone_in_the_overlap_and_matches_eq_9():
    r_g = torch.full((5,), 0.2, dtype=torch.float64)
    r_c = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.35], dtype=torch.float64)
    lam = adaptive_weights(r_c, r_g)
    assert bool((lam[1:] > lam[:-1]).all())
    o = torch.tensor([0.1, 0.3], dtype=torch.float64)
    lam = adaptive_weights(o, torch.ones(2, dtype=torch.float64))            # tau = .2, T = .02
    assert lam.tolist() == pytest.approx([_sig(-5), _sig(5)])
    assert adaptive_weights(o, torch.ones(2, dtype=torch.float64), tau_o=0.1, t_o_factor=1.0).tolist() == \
        pytest.approx([0.5, _sig(2)])


def test_alignment_loss_sums_over_top_k_and_globally_prominent_experts():
    logp = torch.log(torch.tensor([[0.75, 0.25]]))
    r_g = torch.tensor([0.6, 0.4])                                          # G = {0} (r_g >= 1/2)
    one = alignment_loss(logp, torch.tensor([[0]]), r_g, torch.ones(2))
    assert float(one) == pytest.approx(0.6 * math.log(0.6 / 0.75))
    both = alignment_loss(logp, torch.tensor([[1]]), r_g, torch.tensor([0.5, 2.0]))
    assert float(both) == pytest.approx(0.5 * 0.6 * math.log(0.6 / 0.75) + 2.0 * 0.4 * math.log(0.4 / 0.25))


def _submoe():
    from moe_model.submoe import SubMoE

    return SubMoE(tiny_spec(num_experts=E), {1: [0, 2, 3]}, "t", 2, None)


def test_regulariser_gradient_reaches_the_router_rows_only():
    from moe_model.stats import ActivationStats

    m = _submoe()
    r_g = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    (term,) = terms_for(TrainConfig(collect_hidden=True), [Objective(name="fedalign_align", params={"mu": 1.0})],
                        m.adapter_state(), {RG_TENSOR: r_g})
    ActivationStats(m.model.moe_blocks(), E, hidden=True)                  # what the client builds each round
    term.before_training(m)
    batch, _ = m.collate([("markets fell sharply on the news today", 0), ("the team won the final", 1)])
    loss = term(m, batch, m(batch))
    loss.backward()
    grads = {k: p.grad for k, p in m.trainable().items()}
    assert all(grads[f"router.1.{e}"] is not None and grads[f"router.1.{e}"].abs().sum() > 0 for e in (0, 2, 3))
    others = [k for k in grads if not k.startswith("router.")]
    assert any(k.startswith("expert.") for k in others) and any(k.startswith("backbone.") for k in others)
    assert all(grads[k] is None or float(grads[k].abs().sum()) == 0 for k in others), \
        [k for k in others if grads[k] is not None and grads[k].abs().sum() > 0]
    # the same loss through the recorded probabilities would have moved the backbone: the test can fail
    m.zero_grad()
    torch.log(m.model.moe_blocks()[1].last.probs).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for k, p in m.trainable().items()
               if k.startswith("backbone."))
    assert term.statistics()["reg"][0] == pytest.approx(loss.item())


def test_the_term_refuses_a_missing_or_ill_formed_reference():
    train = TrainConfig(collect_hidden=True)
    obj = [Objective(name="fedalign_align")]
    with pytest.raises(ValueError, match="needs the extra tensor fedalign.r_g"):
        terms_for(train, obj, {})
    with pytest.raises(ValueError, match="sum to 1"):
        terms_for(train, obj, {}, {RG_TENSOR: torch.tensor([[0.5, 0.6]])})
    with pytest.raises(ValueError, match="finite"):
        terms_for(train, obj, {}, {RG_TENSOR: torch.tensor([[float("nan"), 1.0]])})
    with pytest.raises(ValueError, match="collect_hidden"):
        terms_for(TrainConfig(), obj, {}, {RG_TENSOR: torch.tensor([[0.5, 0.5]])})
    (term,) = terms_for(train, obj, {}, {RG_TENSOR: torch.tensor([[0.5, 0.5]])})
    with pytest.raises(ValueError, match="1 MoE layers of 4 experts"):
        term.before_training(_submoe())


# --------------------------------------------------------------------------- the round engine and a real federation


def _honest(agg, d: str, ref, **over) -> Stats:
    """Stats a fedalign device would send: r_c uniform over its held experts, h_c for each."""
    rnd, st = agg.engine.current, _stats(agg, d, ref, 10)
    layers = []
    for ls in st.layers:
        held = rnd.selected[d][ls.layer]
        layers.append(ls.model_copy(update={
            "routing_dist": [1 / len(held) if e in held else 0.0 for e in range(len(ls.usage))],
            "margin": [0.2 if e in held else 0.0 for e in range(len(ls.usage))],
            "hidden_mean": [[0.1 * (e + 1)] * 32 if e in held else None for e in range(len(ls.usage))], **over}))
    return st.model_copy(update={"layers": layers})


def test_bad_fedalign_stats_are_refused_with_a_reply_and_r_g_survives_a_restart(tmp_path, monkeypatch):
    agg, replies = _offline(str(tmp_path), monkeypatch, strategy={"name": "fedalign"})
    for d in ("a", "b"):
        _hello(agg, d)
    assert agg.engine.start_round()
    rnd = agg.engine.current
    E4 = agg.model.spec.num_experts
    for d in ("a", "b"):
        assert rnd.train[d]["collect_hidden"] is True
        assert [o.name for o in rnd.objectives[d]] == ["fedalign_align"]
        assert torch.allclose(rnd.tensors[d][RG_TENSOR], torch.full((1, E4), 1 / E4))
    _send(agg, "a", _stats(agg, "a", _upload(agg, "a", 0.01), 10))          # routing_dist 0.5 everywhere
    assert "a" not in rnd.stats
    assert any((c.reason or "").startswith("stats rejected: fedalign: layer") for d, c in replies if d == "a"), replies
    _send(agg, "a", _honest(agg, "a", _upload(agg, "a", 0.01)))
    _send(agg, "b", _honest(agg, "b", _upload(agg, "b", 0.02)))
    assert rnd.reported("a") and rnd.reported("b")
    record = agg.engine.close_round()
    assert record["status"] == "ok" and record["strategy_metrics"]["experts"]["aggregated"] > 0
    r_g = agg.model.owned[RG_TENSOR]
    assert float(r_g.sum()) == pytest.approx(1.0)
    assert agg.engine.start_round()                                         # round 2 in flight, then a restart
    agg.store.close()
    again, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "fedalign"})
    assert torch.equal(again.model.owned[RG_TENSOR], r_g) and again.engine.strategy.hidden == {1: 32}
    cur = again.engine.current
    assert cur.number == 2 and all(torch.equal(cur.tensors[d][RG_TENSOR], r_g) for d in cur.selected)
    again.store.close()


@pytest.mark.slow
def test_fedalign_federation_on_the_embedded_broker(tmp_path, embedded_url):
    fed = Federation(embedded_url, str(tmp_path), rounds=2, experts=(2, 4),
                     config_kw={"strategy": StrategyConfig(name="fedalign")})
    records = fed.run()
    assert [r["status"] for r in records] == ["ok", "ok"] and all(r["strategy"] == "fedalign" for r in records)
    for r in records:
        m = r["strategy_metrics"]
        assert set(m["regulariser"]) == {"dev0", "dev1"} and all(math.isfinite(v) for v in m["regulariser"].values())
        assert m["experts"]["aggregated"] > 0 and sum(m["r_g"]["1"]) == pytest.approx(1.0, abs=1e-5)
    r_g = fed.aggregator.model.owned[RG_TENSOR]
    assert r_g.shape == (1, 4) and not torch.allclose(r_g, torch.full((1, 4), 0.25))
    assert all(len(c.history) == 2 and not c.notices for c in fed.clients)
