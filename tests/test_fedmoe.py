"""FedMoE (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304): sub-model search (eq. 3), estimation of p for
memory-insufficient devices, expert recommendation (eq. 4-6), randomMoE, multi-task heads."""

import random
from types import SimpleNamespace

import pytest
import torch

from cloud.aggregation import get_aggregation
from cloud.assignment import get_assignment
from cloud.assignment.recommendation import cosine, estimate_hat, recommend, top_similar
from cloud.assignment.fedmoe import estimate_p, headroom_limit, normalise, search_threshold, smallest_sets
from cloud.strategy import ClientResult, DeviceView
from protocol import keys

P = {0: [0.5, 0.3, 0.15, 0.05], 1: [0.4, 0.4, 0.1, 0.1]}


def per_expert(cost):
    return lambda ex: cost * sum(len(v) for v in ex.values())


def test_smallest_sets_reach_theta_with_fewest_experts():
    assert smallest_sets(P, 0.5) == {0: [0], 1: [0, 1]}
    assert smallest_sets(P, 0.0) == {0: [0], 1: [0]}  # min_experts = 1
    assert smallest_sets(P, 0.96) == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert normalise({0: [2.0, 2.0]}) == {0: [0.5, 0.5]}  # top-k counted p sums to k
    assert normalise({0: [0.0, 0.0]}) == {0: [0.5, 0.5]}


def test_binary_search_largest_theta_respecting_alpha_m():
    mem = per_expert(10)  # 10 bytes per expert, nothing fixed
    # alpha 0.8 of M = 62.5 -> 50 bytes -> at most 5 experts: theta 0.8 (2 + 2 experts);
    # theta just above 0.8 needs 3 + 3 = 6.
    theta, sets = search_threshold(P, mem, headroom_limit(62.5, 0, 0.8), tol=1e-4)
    assert 0.8 - 1e-4 <= theta <= 0.8 + 1e-9
    assert sets == {0: [0, 1], 1: [0, 1]} and mem(sets) <= 0.8 * 62.5
    # with alpha = 1 the same budget admits 6 experts: theta 0.9
    theta1, sets1 = search_threshold(P, mem, headroom_limit(62.5, 0, 1.0), tol=1e-4)
    assert 0.9 - 1e-4 <= theta1 <= 0.9 + 1e-9 and sets1 == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert search_threshold(P, mem, 100)[0] == 1.0  # everything fits
    assert search_threshold(P, mem, 15) is None  # not even one expert per layer


def test_binary_search_matches_brute_force_on_random_tables():
    rng = random.Random(3)
    for _ in range(40):
        L, E = rng.randint(1, 3), rng.randint(2, 6)
        p = {layer: [rng.random() for _ in range(E)] for layer in range(L)}
        cost = {(layer, e): rng.randint(1, 9) for layer in range(L) for e in range(E)}
        mem = lambda ex: 5 + sum(cost[(layer, e)] for layer, v in ex.items() for e in v)  # noqa: E731
        limit = headroom_limit(rng.randint(10, 80), 5, 0.8)
        q = normalise(p)
        # feasible thetas form [0, theta*]; theta* is a cumulative-sum breakpoint
        cands = {0.0, 1.0} | {sum(sorted(row, reverse=True)[:j]) for row in q.values() for j in range(1, E + 1)}
        feasible = [t for t in cands if t <= 1 and mem(smallest_sets(q, t)) <= limit]
        got = search_threshold(p, mem, limit, tol=1e-4)
        if not feasible:
            assert got is None
            continue
        best = max(feasible)
        theta, sets = got
        assert best - 1e-4 <= theta <= best + 1e-9 and mem(sets) <= limit


def test_estimate_is_sample_weighted_mean_of_same_task_or_all():
    p1, p2, p3 = {1: [1.0, 0.0]}, {1: [0.0, 1.0]}, {1: [0.5, 0.5]}
    reports = [("bbc", 10, p1), ("bbc", 30, p2), ("tweets", 100, p3)]
    assert estimate_p("bbc", reports) == {1: [0.25, 0.75]}
    assert estimate_p("tweets", reports) == {1: [0.5, 0.5]}
    other = estimate_p("news", reports)  # nobody shares the task: all devices, weights 10/30/100
    assert other[1] == pytest.approx([(10 + 50) / 140, (30 + 50) / 140])
    assert estimate_p("bbc", []) is None


def stats(p, acc=None):
    return SimpleNamespace(layers=[SimpleNamespace(layer=layer, activation_prob=row) for layer, row in p.items()],
                           val_accuracy=acc)


def res(d, experts, p, acc=None, task="bbc", n=100):
    return ClientResult(d, task, n, experts, {}, stats(p, acc))


def dev(d, cap, task="bbc", n=100, budget=100, cost=10):
    return DeviceView(d, task, n, budget, cap, per_expert(cost))


def test_stage_one_probes_big_devices_and_estimates_small_ones():
    s = get_assignment("fedmoe")([1], 4, alpha=0.8, probe_steps=3)
    big = dev("big", 4, budget=40)          # holds all 4 experts (40 bytes)
    small = dev("small", 2, budget=25)      # holds 2; alpha limit 20 bytes -> 2 experts
    plan = s.configure(1, [big, small])
    assert plan.assignments["big"] == {1: [0, 1, 2, 3]} and plan.train["big"] == {"max_steps": 3}
    assert plan.info["probing"] == ["big"] and plan.info["searched"]["small"]["p"] == "provisional"
    probe = {1: [0.1, 0.2, 0.6, 0.3]}
    s.observe(1, [res("big", {1: [0, 1, 2, 3]}, probe, 0.5), res("small", plan.assignments["small"], {1: [0] * 4})],
              [])
    plan2 = s.configure(2, [big, small])
    # big: its own probe p, 32 bytes allowed -> 3 experts reaching the largest theta
    assert plan2.assignments["big"] == {1: [1, 2, 3]} and "big" not in plan2.train
    # small was provisional: searched again from the estimate (big's p, same task)
    assert plan2.info["searched"]["small"]["p"] == "estimated" and plan2.assignments["small"] == {1: [2, 3]}
    assert s.map["small"] == {1: [2, 3]} and s.state_dict()["initial"]["small"] == {"1": [2, 3]}
    restored = get_assignment("fedmoe")([1], 4)
    restored.load_state_dict(s.state_dict())
    assert restored.configure(3, [big, small]).assignments == plan2.assignments


def test_random_same_size_same_sizes_random_experts():
    f = get_assignment("fedmoe")([1, 3], 8, seed=1)
    r = get_assignment("random_same_size")([1, 3], 8, seed=1)
    devs = [DeviceView(f"d{i}", "bbc", 10, 60 + 10 * i, 4, per_expert(5)) for i in range(4)]  # no probe
    pf, pr = f.configure(1, devs).assignments, r.configure(1, devs).assignments
    assert {d: {k: len(v) for k, v in e.items()} for d, e in pf.items()} == \
        {d: {k: len(v) for k, v in e.items()} for d, e in pr.items()}
    assert pf != pr
    assert r.configure(2, devs).assignments == pr  # kept


def test_similarity_and_estimate_hat():
    assert cosine([1, 0], [0, 1]) == 0 and cosine([1, 1], [2, 2]) == pytest.approx(1)
    assert cosine([0, 0], [1, 0]) == 0
    others = {"a": {1: [1.0, 0.0]}, "b": {1: [0.0, 1.0]}, "c": {1: [1.0, 1.0]}}
    top = top_similar({1: [1.0, 0.0]}, others, 2)
    assert [d for d, _ in top] == ["a", "c"]
    hat = estimate_hat(top, others)  # weights 1 and 1/sqrt(2)
    w = 1 / 2**0.5
    assert hat[1] == pytest.approx([(1 + w) / (1 + w), w / (1 + w)])


OWN_P = {1: [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]}
SIMILAR = {"a": {1: [0.4, 0.3, 0.2, 0.1, 0.0, 0.0]}, "b": {1: [0.4, 0.4, 0.05, 0.15, 0.0, 0.0]},
           "far": {1: [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]}}


def test_recommendation_adds_the_right_experts():
    # top-2 similar are a and b with 4 experts each; far (6 experts) is ignored -> n = 4 - 2 = 2;
    # p_hat outside {0,1}: e2 ~0.125, e3 ~0.125 (both above e4, e5 = 0)
    new = recommend(OWN_P, {1: [0, 1]}, SIMILAR, {"a": 4, "b": 4, "far": 6}, k=2)
    assert new == {1: [0, 1, 2, 3]}
    # only one more expert fits the budget
    new = recommend(OWN_P, {1: [0, 1]}, SIMILAR, {"a": 4, "b": 4, "far": 6}, k=2,
                    fits=lambda ex: len(ex[1]) <= 3)
    assert new == {1: [0, 1, 3]}  # e3: p_hat (0.1*s_a + 0.15*s_b) > e2's (0.2*s_a + 0.05*s_b)


def test_recommendation_prunes_the_right_experts():
    own = {1: [0, 1, 2, 3, 4]}
    new = recommend(OWN_P, own, SIMILAR, {"a": 2, "b": 2, "far": 8}, k=2)  # n = 2 - 5 = -3
    assert new == {1: [0, 1]}  # drops e4 (p_hat 0), then e2/e3 (lowest)
    assert recommend(OWN_P, {1: [0, 4]}, SIMILAR, {"a": 1, "b": 1}, k=2, min_experts=1) == {1: [0]}
    assert recommend(OWN_P, own, {}, {}) is None


def test_recommendation_is_exploratory_reverted_and_frozen():
    s = get_assignment("fedmoe")([1], 6, patience=2, similar=2)
    s.map = {"me": {1: [0, 1]}, "a": {1: [0, 1, 2, 3]}, "b": {1: [0, 1, 2, 3]}, "far": {1: [4, 5]}}
    s.p = {"me": OWN_P, **SIMILAR}
    s.meta = {"me": {"budget": 10**9}}
    me = lambda acc: [res("me", s.map["me"], OWN_P, acc)]  # noqa: E731
    s.observe(1, me(0.6), [])  # best 0.6
    s.observe(2, me(0.6), [])  # stale 1
    assert s.map["me"] == {1: [0, 1]}
    s.observe(3, me(0.55), [])  # stale 2 = patience -> recommend
    assert s.map["me"] == {1: [0, 1, 2, 3]} and "me" in s.pending  # top-2 (a, b) hold 4: n = 2
    s.observe(4, me(0.6), [])  # not better than 0.6: revert and freeze
    assert s.map["me"] == {1: [0, 1]} and "me" in s.frozen and "me" not in s.pending
    for r in range(5, 10):
        s.observe(r, me(0.1), [])
    assert s.map["me"] == {1: [0, 1]}  # frozen: no more changes
    assert [e["event"] for h in s.history for e in h["events"]] == ["recommended", "reverted"]


def test_recommendation_kept_when_score_improves():
    s = get_assignment("fedmoe")([1], 6, patience=1, similar=2)
    s.map = {"me": {1: [0, 1]}, "a": {1: [0, 1, 2, 3]}, "b": {1: [0, 1, 2, 3]}}
    s.p = {"me": OWN_P, **{k: v for k, v in SIMILAR.items() if k != "far"}}
    s.observe(1, [res("me", {1: [0, 1]}, OWN_P, 0.5)], [])
    s.observe(2, [res("me", {1: [0, 1]}, OWN_P, 0.5)], [])
    assert s.map["me"] == {1: [0, 1, 2, 3]}
    s.observe(3, [res("me", {1: [0, 1, 2, 3]}, OWN_P, 0.7)], [])
    assert s.map["me"] == {1: [0, 1, 2, 3]} and "me" not in s.frozen and s.best["me"] == 0.7


def test_w_o_stage_two_never_changes_the_map():
    s = get_assignment("fedmoe")([1], 6, patience=1, stage2=False)
    s.map = {"me": {1: [0, 1]}, "a": {1: [0, 1, 2, 3]}}
    s.p = {"me": OWN_P, "a": SIMILAR["a"]}
    for r in range(1, 5):
        s.observe(r, [res("me", {1: [0, 1]}, OWN_P, 0.5)], [])
    assert s.map["me"] == {1: [0, 1]}


def test_w_o_stage_one_does_not_probe():
    s = get_assignment("fedmoe")([1], 4, stage1=False, seed=2)
    plan = s.configure(1, [dev("big", 4, budget=40)])
    assert not plan.train and plan.info["searched"]["big"]["p"].startswith("uniform")
    assert sum(len(v) for v in plan.assignments["big"].values()) == 3  # 32 bytes allowed


def test_multi_task_heads_never_mix():
    g = {"backbone.q.lora_B": torch.zeros(2), "head.bbc.weight": torch.zeros(5), "head.tweets.weight": torch.zeros(3),
         "expert.1.0.fc1.lora_B": torch.zeros(2), "router.1.0": torch.zeros(2)}
    devices = [("b1", "bbc", 1.0, 10), ("b2", "bbc", 3.0, 30), ("t1", "tweets", 100.0, 50)]
    results = []
    for d, task, v, n in devices:
        held = keys.select(g, {1: [0]}, task)
        assert {k for k in held if k.startswith("head.")} == {f"head.{task}.weight"}
        results.append(ClientResult(d, task, n, {1: [0]}, {k: torch.full_like(t, v) for k, t in held.items()}, None))
    out = get_aggregation("modular")().aggregate(1, g, results, [])
    assert torch.allclose(out["head.bbc.weight"], torch.full((5,), (10 * 1 + 30 * 3) / 40))
    assert torch.allclose(out["head.tweets.weight"], torch.full((3,), 100.0))  # tweets only
    assert torch.allclose(out["backbone.q.lora_B"], torch.full((2,), (10 + 90 + 5000) / 90))  # shared by all


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError):
        get_assignment("fedmoe")([1], 4, alpha=1.5)
    with pytest.raises(TypeError):
        get_assignment("fedmoe")([1], 4, nope=1)
    with pytest.raises(ValueError):
        normalise({0: [float("nan"), 1.0]})
