"""FLEX-MoE: fitness EMA, dynamic bounds, the assignment program (exact and fast), the
fallbacks, greedy/random baselines and usage-weighted aggregation (hand-computed values)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cloud.aggregation import get_aggregation
from cloud.assignment import get_assignment
from cloud.assignment.fitness import Fitness, top_k_rows
from cloud.assignment.flex import Bounds, LoadBounds, solve_exact, solve_layer
from cloud.assignment.lp_fast import lagrangian_bound, solve_fast, solve_lp
from cloud.metrics import coefficient_of_variation, max_min_gap
from cloud.strategy import ClientResult, DeviceView


def stats(layer_acc):
    """Minimal stand-in for protocol Stats: layer -> (acc list, loss list, usage list)."""
    return SimpleNamespace(layers=[SimpleNamespace(layer=l, expert_acc=a, expert_loss=lo, usage=u)
                                   for l, (a, lo, u) in layer_acc.items()])


def instance(C, E, seed, ratio=0.1):
    rng = np.random.default_rng(seed)
    q = rng.random((C, E))
    sizes = rng.integers(20, 200, C).astype(float)
    k = rng.integers(2, min(6, E) + 1, C)
    tau = (sizes * k).sum() / E
    return q, sizes, k, np.full(E, tau * (1 - ratio)), np.full(E, tau * (1 + ratio))


def test_ema_acc_and_loss_hand_computed():
    f = Fitness([1], 3, "acc", beta=0.1, q0=0.2)
    r = ClientResult("a", "t", 10, {1: [0, 2]}, {}, stats({1: ([0.7, None, None], [0.5, None, 2.0], [5, 0, 0])}))
    f.update([r])
    # held & reported: 0.9*0.2 + 0.1*0.7; held but no sample majority-routed: carried; not held: carried
    assert f.row(1, "a") == pytest.approx([0.25, 0.2, 0.2])
    f.update([r])
    assert f.row(1, "a")[0] == pytest.approx(0.9 * 0.25 + 0.07)
    g = Fitness([1], 3, "loss", alpha_L=2.0, beta=0.5, q0=0.2)
    g.update([r])
    assert g.row(1, "a") == pytest.approx([0.1 + 0.5 * math.exp(-1.0), 0.2, 0.1 + 0.5 * math.exp(-4.0)])
    assert g.row(1, "unseen") == [0.2] * 3
    h = Fitness([1], 3)
    h.load_state_dict(g.state_dict())
    assert h.row(1, "a") == g.row(1, "a")


def test_dynamic_bounds_hand_computed():
    lb = LoadBounds(2, gamma=0.3, alpha_adj=0.5, delta_ratio=0.1)
    sizes, k = np.array([100.0, 300.0]), np.array([1, 1])
    b = lb.bounds(sizes, k)
    assert b.tau == 200 and b.delta == pytest.approx(20)
    assert b.lower.tolist() == pytest.approx([180, 180]) and b.upper.tolist() == pytest.approx([220, 220])
    lb.record(np.array([[1, 0], [1, 0]]), sizes, b.tau)  # W = [400, 0], d = [200, -200]
    b2 = lb.bounds(sizes, k)
    assert lb.deficit.tolist() == pytest.approx([60, -60])  # 0.7*0 + 0.3*d
    assert b2.target.tolist() == pytest.approx([170, 230])  # tau - 0.5*D
    assert b2.lower.tolist() == pytest.approx([150, 210]) and b2.upper.tolist() == pytest.approx([190, 250])
    lb.record(np.array([[0, 1], [1, 0]]), sizes, 200.0)  # W = [300, 100], d = [100, -100]
    lb.bounds(sizes, k)
    assert lb.deficit.tolist() == pytest.approx([0.7 * 60 + 30, -0.7 * 60 - 30])
    assert Bounds(10, np.array([10.0]), 1, np.array([9.0]), np.array([11.0])).widened(20).lower.tolist() == [0]


@pytest.mark.parametrize("solver", ["cbc", "highs", "fast"])
@pytest.mark.parametrize("seed", range(4))
def test_assignment_satisfies_capacity_exactly_and_bounds(solver, seed):
    q, sizes, k, lo, up = instance(20, 8, seed, ratio=0.25)
    if solver == "fast":
        r = solve_fast(q, sizes, k, lo, up)
        x = r.x
        assert r.status in ("optimal", "repaired")
    else:
        x, status, obj = solve_exact(q, sizes, k, lo, up, solver)
        assert status == "Optimal" and obj == pytest.approx((q * x).sum())
    assert (x.sum(1) == k).all()  # eq. 11 exactly
    load = sizes @ x
    assert (load >= lo - 1e-6).all() and (load <= up + 1e-6).all()  # eq. 12-13


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_matches_exact_on_small_instances(seed):
    q, sizes, k, lo, up = instance(60, 8, seed, ratio=0.2)
    x_exact, status, best = solve_exact(q, sizes, k, lo, up, "cbc")
    r = solve_fast(q, sizes, k, lo, up)
    assert status == "Optimal" and r.x is not None
    assert r.lp_bound >= best - 1e-6  # relaxation bounds the IP from above
    assert r.objective <= best + 1e-6 and r.objective >= best * (1 - 0.01)
    xlp, value = solve_lp(q, sizes, k, lo, up)
    mu = np.zeros(8)
    assert lagrangian_bound(q, sizes, k, lo, up, mu) >= value - 1e-9  # any multipliers bound the LP


def test_highs_and_cbc_agree():
    q, sizes, k, lo, up = instance(15, 6, 11, ratio=0.3)
    _, _, a = solve_exact(q, sizes, k, lo, up, "cbc")
    _, _, b = solve_exact(q, sizes, k, lo, up, "highs")
    assert a == pytest.approx(b, rel=1e-6)


def test_greedy_picks_row_wise_top_k():
    q = np.array([[0.9, 0.1, 0.5, 0.3], [0.0, 0.2, 0.1, 0.8]])
    assert top_k_rows(q, np.array([2, 1])).tolist() == [[True, False, True, False], [False, False, False, True]]
    s = get_assignment("greedy")([1], 4, seed=0)
    s.fitness.q[1] = {"a": [0.9, 0.1, 0.5, 0.3], "b": [0.0, 0.2, 0.1, 0.8]}
    plan = s.configure(1, [DeviceView("a", "t", 10, 1, 2), DeviceView("b", "t", 10, 1, 3)])
    assert plan.assignments == {"a": {1: [0, 2]}, "b": {1: [1, 2, 3]}}


def test_random_redraw_uses_capacity_and_redraws():
    s = get_assignment("random_redraw")([0, 1], 8, seed=3)
    devs = [DeviceView(f"d{i}", "t", 10, 1, 2 + i % 5) for i in range(10)]
    p1, p2 = s.configure(1, devs).assignments, s.configure(2, devs).assignments
    assert all(len(p1[d.device_id][l]) == d.capacity for d in devs for l in (0, 1))
    assert p1 != p2


@pytest.mark.parametrize("max_widen,status", [(6, "widened"), (2, "greedy_fallback")])
def test_infeasible_bounds_widen_then_fall_back_to_greedy(max_widen, status):
    # one client of 100 samples, one expert: any expert's load is 0 or 100, bounds 45..55
    q, sizes, k = np.array([[0.3, 0.6]]), np.array([100.0]), np.array([1])
    b = LoadBounds(2).bounds(sizes, k)
    x, info = solve_layer(q, sizes, k, b, "cbc", max_widen=max_widen)
    assert info["status"] == status and x.sum() == 1
    if status == "widened":
        assert info["widenings"] == 4 and info["delta"] == pytest.approx(5 * 2**4)  # delta 80 -> L = 0
        assert info["lower"][1] <= 100 <= info["upper"][1] or info["lower"][0] <= 100 <= info["upper"][0]
    else:
        assert x.tolist() == [[False, True]]  # greedy: the higher Q


def test_solver_failure_falls_back_to_greedy_and_bad_solver_fails_at_configuration(monkeypatch):
    import cloud.assignment.flex as flex_module

    def broken(*a, **kw):
        raise RuntimeError("solver crashed")

    monkeypatch.setattr(flex_module, "solve_exact", broken)
    q, sizes, k = np.array([[0.3, 0.6], [0.8, 0.1]]), np.array([100.0, 50.0]), np.array([1, 1])
    x, info = solve_layer(q, sizes, k, LoadBounds(2).bounds(sizes, k), "highs")
    assert info["status"] == "greedy_fallback" and info["solver_error"] == "RuntimeError: solver crashed"
    assert x.tolist() == [[False, True], [True, False]]
    with pytest.raises(RuntimeError, match="solver crashed"):
        solve_layer(q, sizes, k, LoadBounds(2).bounds(sizes, k), "highs", on_solver_error="fail")
    with pytest.raises(ValueError, match="unknown solver"):
        get_assignment("flex")([1], 4, solver="gurobi")
    with pytest.raises(ValueError, match="on_solver_error"):
        get_assignment("flex")([1], 4, on_solver_error="ignore")


def _flex_with_preferences(**params):
    s = get_assignment("flex")([1, 3], 4, solver="cbc", **params)
    for layer in (1, 3):
        s.fitness.q[layer] = {"a": [0.9, 0.1, 0.5, 0.3], "b": [0.0, 0.2, 0.1, 0.8]}
    return s, [DeviceView("a", "t", 10, 1, 2), DeviceView("b", "t", 10, 1, 2)]  # tau 10: feasible at once


def test_solver_exception_greedy_mode_logs_once_per_round_and_records_it(monkeypatch, caplog):
    import cloud.assignment.flex as flex_module

    calls = []

    def broken(*a, **kw):
        calls.append(a)
        raise RuntimeError("solver crashed")

    monkeypatch.setattr(flex_module, "solve_exact", broken)
    s, devs = _flex_with_preferences()  # default on_solver_error: greedy
    with caplog.at_level("DEBUG", logger="cloud.assignment.flex"):
        plan = s.configure(1, devs)
    assert len(calls) == 2  # one attempt per layer, no widening after an exception
    assert plan.assignments == {"a": {1: [0, 2], 3: [0, 2]}, "b": {1: [1, 3], 3: [1, 3]}}  # greedy top-k of Q
    assert plan.info["status"] == "greedy_fallback" and plan.info["solver_error"] == "RuntimeError: solver crashed"
    assert all(plan.info["layers"][l]["solver_error"] == "RuntimeError: solver crashed" for l in ("1", "3"))
    errors = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert len(errors) == 1 and errors[0].levelname == "ERROR"  # once per round, not once per layer
    assert "solver crashed" in errors[0].getMessage() and "1, 3" in errors[0].getMessage()
    assert s.loads[1].last_load is not None  # the greedy round was recorded for the next bounds


def test_solver_exception_fail_mode_propagates_and_keeps_state(monkeypatch, caplog):
    import cloud.assignment.flex as flex_module

    real = flex_module.solve_exact
    s, devs = _flex_with_preferences(on_solver_error="fail")
    first = s.configure(1, devs)
    assert first.info["status"] == "optimal" and "solver_error" not in first.info
    assert first.assignments == {"a": {1: [0, 2], 3: [0, 2]}, "b": {1: [1, 3], 3: [1, 3]}}
    before = {layer: lb.state_dict() for layer, lb in s.loads.items()}
    layer_calls = []

    def broken_on_second_layer(*a, **kw):  # layer 1 solves (and records its load), layer 3 crashes
        layer_calls.append(a)
        if len(layer_calls) == 2:
            raise RuntimeError("solver crashed")
        return real(*a, **kw)

    monkeypatch.setattr(flex_module, "solve_exact", broken_on_second_layer)
    with caplog.at_level("WARNING", logger="cloud.assignment.flex"), pytest.raises(RuntimeError, match="crashed"):
        s.configure(2, devs)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # the caller reports it, not the strategy
    assert {layer: lb.state_dict() for layer, lb in s.loads.items()} == before  # bounds state restored

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(flex_module, "solve_exact", interrupted)
    greedy, devs = _flex_with_preferences()  # even in greedy mode a KeyboardInterrupt is never swallowed
    with pytest.raises(KeyboardInterrupt):
        greedy.configure(1, devs)


def test_flex_strategy_balances_where_greedy_does_not():
    devs = [DeviceView(f"d{i}", "t", 100, 1, 2) for i in range(8)]
    flex, greedy = get_assignment("flex")([1], 4, solver="cbc"), get_assignment("greedy")([1], 4)
    pref = {f"d{i}": [0.9, 0.8, 0.1, 0.1] for i in range(8)}  # everyone prefers experts 0 and 1
    flex.fitness.q[1], greedy.fitness.q[1] = dict(pref), dict(pref)
    pf, pg = flex.configure(1, devs), greedy.configure(1, devs)
    load = lambda p: np.bincount([e for a in p.assignments.values() for e in a[1]], minlength=4)  # noqa: E731
    assert load(pg).tolist() == [8, 8, 0, 0]
    assert load(pf).tolist() == [4, 4, 4, 4] and pf.info["status"] == "optimal"
    assert coefficient_of_variation(load(pf)) == 0 and max_min_gap(load(pg)) == 8
    r = ClientResult("d0", "t", 100, pf.assignments["d0"], {}, stats({1: ([1.0] * 4, [0.0] * 4, [1] * 4)}))
    flex.observe(1, [r], [])
    other = get_assignment("flex")([1], 4)
    other.load_state_dict(flex.state_dict())
    assert other.fitness.row(1, "d0") == flex.fitness.row(1, "d0")
    assert other.loads[1].last_load.tolist() == flex.loads[1].last_load.tolist()


def test_usage_weighted_aggregation_hand_computed():
    g = {"expert.1.0.fc1.lora_B": torch.zeros(2), "expert.1.1.fc1.lora_B": torch.full((2,), 7.0),
         "router.1.0": torch.zeros(2), "router.1.1": torch.zeros(2), "backbone.q.lora_B": torch.zeros(2),
         "head.t.weight": torch.zeros(2)}
    a = ClientResult("a", "t", 10, {1: [0, 1]}, {"expert.1.0.fc1.lora_B": torch.ones(2),
                                                  "expert.1.1.fc1.lora_B": torch.ones(2),
                                                  "router.1.0": torch.ones(2), "router.1.1": torch.ones(2),
                                                  "backbone.q.lora_B": torch.ones(2), "head.t.weight": torch.ones(2)},
                     stats({1: (None, None, [30, 0])}))
    b = ClientResult("b", "t", 30, {1: [0, 1]}, {"expert.1.0.fc1.lora_B": torch.full((2,), 5.0),
                                                  "expert.1.1.fc1.lora_B": torch.full((2,), 5.0),
                                                  "router.1.0": torch.full((2,), 5.0),
                                                  "router.1.1": torch.full((2,), 5.0),
                                                  "backbone.q.lora_B": torch.full((2,), 5.0),
                                                  "head.t.weight": torch.full((2,), 5.0)},
                     stats({1: (None, None, [10, 0])}))
    out = get_aggregation("usage_weighted")().aggregate(1, g, [a, b], [])
    assert torch.allclose(out["expert.1.0.fc1.lora_B"], torch.full((2,), (30 * 1 + 10 * 5) / 40))  # eq. 4
    assert torch.allclose(out["router.1.0"], torch.full((2,), 2.0))
    assert torch.equal(out["expert.1.1.fc1.lora_B"], torch.full((2,), 7.0))  # zero usage: unchanged
    assert torch.allclose(out["backbone.q.lora_B"], torch.full((2,), (10 + 150) / 40))  # eq. 3, |D_c|
    assert torch.allclose(out["head.t.weight"], torch.full((2,), 4.0))


def test_cv_and_max_min_on_known_load():
    w = [100, 300, 200, 200]  # mean 200, population std sqrt(5000)
    assert coefficient_of_variation(w) == pytest.approx(math.sqrt(5000) / 200)
    assert max_min_gap(w) == 200


def test_assigned_load_sums_holders_samples_and_its_window_cv():
    from cloud.metrics import LoadWindow, assigned_load

    a = assigned_load([(10, {1: [0, 2]}), (30, {1: [2, 3]}), (5, {7: [0]})], [1], 4)
    assert a == {1: [10, 0, 40, 30]}  # layer 7 is not a MoE layer here: ignored
    w = LoadWindow([1], 4)
    w.add(a)
    s = w.summary("assigned_")
    assert s["assigned_cv"] == pytest.approx(np.std([10, 0, 40, 30]) / np.mean([10, 0, 40, 30]))
    assert set(s) == {"assigned_cv", "assigned_max_min_gap", "assigned_cv_per_layer", "assigned_max_min_gap_per_layer"}


def test_flex_usage_drives_the_deficit_by_reported_usage_hand_computed():
    """Two devices of 100 samples hold 2 of E = 4 experts each: flex's deficit follows the
    assigned volume, flex_usage's the usage the devices reported (rescaled to samples)."""
    devs = [DeviceView(f"d{i}", "t", 100, 10**9, 2) for i in range(2)]
    plain, usage = get_assignment("flex")([1], 4, gamma=1.0), get_assignment("flex_usage")([1], 4, gamma=1.0)
    results = []
    for flex in (plain, usage):
        plan = flex.configure(1, devs)
        results = [ClientResult(d, "t", 100, plan.assignments[d], {},
                                stats({1: ([0.5] * 4, [1.0] * 4, [0] * 4)})) for d in plan.assignments]
        load = flex.loads[1].last_load.copy()
        # the routers sent 300 tokens to the first held expert of d0 and 100 to every other held slot
        for r in results:
            held = r.experts[1]
            r.stats.layers[0].usage = [300 if (r.device_id == "d0" and e == held[0]) else (100 if e in held else 0)
                                       for e in range(4)]
        flex.observe(1, results, [])
        flex.configure(2, devs)  # folds last round's deviation into D (gamma = 1: D = d)
        tau = 100 * 2 * 2 / 4
        if flex is plain:
            assert flex.loads[1].deficit == pytest.approx(load - tau)
        else:
            u = np.zeros(4)
            for r in results:
                u += r.stats.layers[0].usage
            assert flex.loads[1].deficit == pytest.approx(u * load.sum() / u.sum() - tau)
            assert flex.loads[1].deficit.max() > 0  # the over-used expert's target drops
    with pytest.raises(ValueError, match="usage_weight"):
        get_assignment("flex_usage")([1], 4, usage_weight=1.5)


def test_infeasible_layers_log_one_warning_per_round(caplog):
    # one device of 100 samples holding 1 of 4 experts: every layer needs widening
    s = get_assignment("flex")([0, 1, 2], 4, solver="cbc")
    with caplog.at_level("DEBUG", logger="cloud.assignment.flex"):
        plan = s.configure(1, [DeviceView("a", "t", 100, 1, 1)])
    assert plan.info["status"] in ("widened", "greedy_fallback")
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "3 of 3 layer(s)" in warnings[0].getMessage()
