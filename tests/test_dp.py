"""Client-level differential privacy (cloud/robust/dp.py): clipping, noise scale, the
RDP accountant against hand computations, persistence, parameter checks."""

import json
import math
import sys

import pytest
import torch

pytest.importorskip("dp_accounting")

from cloud.robust.dp import DPFedAvg, PrivacyAccountant  # noqa: E402
from cloud.strategy import ClientResult  # noqa: E402


def result(d, state, experts=None, n=10, task="bbc"):
    return ClientResult(d, task, n, experts or {}, state, stats=None)


def clone(state):
    return {k: v.clone() for k, v in state.items()}


# dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS, written out by hand.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]


def eps_by_hand(T, sigma, delta):
    """dp_accounting's compute_epsilon for T rounds of the Gaussian mechanism (q = 1):
    RDP(a) = T a / (2 sigma^2); per order, 0 if delta^2 + expm1(-RDP) > 0 (the KL bound
    delta <= sqrt(1 - exp(-KL))), else for a > 1.01 the improved conversion (Asoodeh et
    al. 2020 / Canonne et al. 2020)
        eps(a) = RDP(a) + log((a - 1) / a) - (log delta + log a) / (a - 1),
    else inf; epsilon = max(0, min over orders)."""
    best = math.inf
    for a in ORDERS:
        r = T * a / (2 * sigma**2)
        if delta**2 + math.expm1(-r) > 0:
            e = 0.0
        elif a > 1.01:
            e = r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
        else:
            e = math.inf
        best = min(best, e)
    return max(0.0, best)


def eps_classic(T, sigma, delta):
    """Mironov 2017, Prop. 3: min over orders of RDP(a) + log(1/delta) / (a - 1)."""
    return min(T * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in ORDERS)


def Phi(x):
    return 0.5 * math.erfc(-x / math.sqrt(2))


def delta_exact_gaussian(eps, sigma):
    """Balle & Wang 2018, Thm. 8: the exact delta(eps) of one Gaussian mechanism with
    sensitivity 1 and noise std sigma."""
    return Phi(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * Phi(-eps * sigma - 1 / (2 * sigma))


# (1) clipping --------------------------------------------------------------------


def test_clipping_single_holder_hand_computed():
    g = {"backbone.a": torch.tensor([1.0, 2.0]), "expert.0.0.w": torch.tensor([0.0, -1.0])}
    # update (6, 0 | 0, 8): norm 10 over both units together
    s = {"backbone.a": torch.tensor([7.0, 2.0]), "expert.0.0.w": torch.tensor([0.0, 7.0])}
    g0, s0 = clone(g), clone(s)
    dp = DPFedAvg(noise_multiplier=0.0, clip_norm=1.0, seed=0)
    out = dp.aggregate(1, g, [result("a", s, {0: [0]})], [])
    assert torch.equal(out["backbone.a"], torch.tensor([1.6, 2.0]))
    assert torch.equal(out["expert.0.0.w"], torch.tensor([0.0, -0.2]))
    step = torch.cat([(out[k] - g[k]).double() for k in g])
    assert float(step.norm()) == pytest.approx(1.0, rel=1e-6)  # float32 rounding of 1.6, -0.2
    assert dp.report["clipped"] == ["a"] and dp.report["update_norms"] == {"a": 10.0}
    assert dp.report["epsilon"] == math.inf and dp.report["rounds"] == 1  # no noise: no privacy
    assert all(torch.equal(g[k], g0[k]) and torch.equal(s[k], s0[k]) for k in g)  # inputs untouched
    assert all(out[k].dtype == g[k].dtype and out[k].shape == g[k].shape for k in g)


def test_uniform_weights_and_unclipped_updates_pass_through():
    g = {"backbone.a": torch.zeros(2, dtype=torch.float64)}
    a = result("a", {"backbone.a": torch.tensor([0.3, 0.4], dtype=torch.float64)}, n=1000)  # norm 0.5
    b = result("b", {"backbone.a": torch.tensor([0.0, 4.0], dtype=torch.float64)}, n=1)  # norm 4 -> 1
    dp = DPFedAvg(noise_multiplier=0.0, clip_norm=1.0)
    out = dp.aggregate(1, g, [a, b], [])
    # (0.3, 0.4) + (0, 1), divided by 2 holders: |D_c| is ignored
    assert torch.allclose(out["backbone.a"], torch.tensor([0.15, 0.7], dtype=torch.float64), atol=1e-15)
    assert dp.report["clipped"] == ["b"]
    assert dp.report["update_norms"] == pytest.approx({"a": 0.5, "b": 4.0})


# (2) noise scale -----------------------------------------------------------------


def test_noise_scale_per_unit_holders():
    sigma, C = 2.0, 0.5
    g = {
        "backbone.w": torch.randn(200, 200, generator=torch.Generator().manual_seed(1)),
        "expert.0.0.w": torch.zeros(150, 150, dtype=torch.float64),
        "router.0.0": torch.zeros(64, dtype=torch.float64),
        "expert.0.1.w": torch.ones(10, 10),
        "router.0.1": torch.ones(64),
        "head.bbc.w": torch.zeros(3, 4),
    }
    # 4 zero updates of the backbone; d0 alone also holds expert (0, 0) with its router row
    mine = {0: ("backbone.w", "expert.0.0.w", "router.0.0")}
    results = [result(f"d{i}", {k: g[k].clone() for k in mine.get(i, ("backbone.w",))}) for i in range(4)]
    g0 = clone(g)
    dp = DPFedAvg(noise_multiplier=sigma, clip_norm=C, seed=123)
    out = dp.aggregate(7, g, results, [])
    bb = (out["backbone.w"].double() - g["backbone.w"].double()).flatten()
    assert abs(float(bb.mean())) < 0.01 * sigma * C
    assert float(bb.std()) == pytest.approx(sigma * C / 4, rel=0.03)  # 4 holders
    ex = torch.cat([(out[k] - g[k]).flatten() for k in ("expert.0.0.w", "router.0.0")])
    assert float(ex.std()) == pytest.approx(sigma * C, rel=0.03)  # 1 holder; its router row too
    for k in ("expert.0.1.w", "router.0.1", "head.bbc.w"):  # nobody held them: no noise
        assert torch.equal(out[k], g[k])
    assert all(out[k].dtype == g[k].dtype and torch.equal(g[k], g0[k]) for k in g)
    assert dp.report["clipped"] == [] and dp.report["update_norms"] == {f"d{i}": 0.0 for i in range(4)}

    again = DPFedAvg(noise_multiplier=sigma, clip_norm=C, seed=123).aggregate(7, g, results, [])
    assert all(torch.equal(again[k], out[k]) for k in g)  # seed + round: reproducible
    other = DPFedAvg(noise_multiplier=sigma, clip_norm=C, seed=123).aggregate(8, g, results, [])
    assert not torch.equal(other["backbone.w"], out["backbone.w"])
    fresh = DPFedAvg(noise_multiplier=sigma, clip_norm=C).aggregate(7, g, results, [])
    assert not torch.equal(fresh["backbone.w"], out["backbone.w"])  # os.urandom without a seed


# (3) the accountant ----------------------------------------------------------------


@pytest.mark.parametrize("T,sigma,delta", [(1, 1.0, 1e-5), (10, 1.0, 1e-5), (100, 4.0, 1e-6), (3, 0.7, 1e-3)])
def test_epsilon_matches_hand_computation(T, sigma, delta):
    acc = PrivacyAccountant(delta)
    for _ in range(T):
        acc.step(sigma)
    assert acc.rounds == T
    eps = acc.epsilon()
    assert eps == pytest.approx(eps_by_hand(T, sigma, delta), rel=1e-6)
    assert eps <= eps_classic(T, sigma, delta) + 1e-12


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    def eps(T, sigma):
        acc = PrivacyAccountant(1e-5)
        for _ in range(T):
            acc.step(sigma)
        return acc.epsilon()

    assert PrivacyAccountant(1e-5).epsilon() == 0.0
    assert 0 < eps(1, 1.0) < eps(2, 1.0) < eps(10, 1.0) < eps(50, 1.0)
    assert eps(10, 0.8) > eps(10, 1.0) > eps(10, 2.0) > eps(10, 8.0) > 0
    poisson = PrivacyAccountant(1e-5)
    poisson.step(1.0, sampling_rate=0.01)
    assert 0 < poisson.epsilon() < eps(1, 1.0)  # amplification only when claimed


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
def test_rdp_epsilon_upper_bounds_the_exact_gaussian(sigma):
    delta = 1e-5
    acc = PrivacyAccountant(delta)
    acc.step(sigma)
    eps = acc.epsilon()
    assert delta_exact_gaussian(eps, sigma) <= delta
    # and it is not vacuous: the exact epsilon at delta (bisection) is within a factor 2
    lo, hi = 0.0, eps
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_exact_gaussian(mid, sigma) > delta else (lo, mid)
    assert hi <= eps < 2 * hi


def test_dp_fedavg_steps_the_accountant_once_per_round():
    g = {"backbone.w": torch.zeros(3)}
    dp = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, seed=0)
    for r in range(1, 4):
        dp.aggregate(r, g, [result("a", {"backbone.w": torch.ones(3)})], [])
    assert dp.report["rounds"] == 3 == dp.accountant.rounds
    assert dp.report["epsilon"] == pytest.approx(eps_by_hand(3, 1.0, 1e-5), rel=1e-6)
    assert {k: dp.report[k] for k in ("delta", "noise_multiplier", "clip_norm")} == {
        "delta": 1e-5, "noise_multiplier": 1.0, "clip_norm": 1.0}
    assert DPFedAvg.label == "dp_fedavg" and DPFedAvg.name == ""


# (4) persistence -------------------------------------------------------------------


def test_state_dict_round_trip():
    acc = PrivacyAccountant(1e-5)
    for s, q in [(1.0, 1.0), (1.0, 1.0), (2.0, 0.1), (1.0, 1.0), (0.8, 1.0)]:
        acc.step(s, q)
    state = json.loads(json.dumps(acc.state_dict()))
    back = PrivacyAccountant(1e-5)
    back.load_state_dict(state)
    assert back.rounds == 5 and back.epsilon() == pytest.approx(acc.epsilon(), rel=1e-12)
    assert back.state_dict() == acc.state_dict()

    dp = DPFedAvg(noise_multiplier=1.5, clip_norm=0.1, seed=3)
    g = {"backbone.w": torch.zeros(4)}
    dp.aggregate(1, g, [result("a", {"backbone.w": torch.ones(4)})], [])
    dp.aggregate(2, g, [result("a", {"backbone.w": torch.ones(4)})], [])
    restored = DPFedAvg(noise_multiplier=1.5, clip_norm=0.1)
    restored.load_state_dict(json.loads(json.dumps(dp.state_dict())))
    assert restored.accountant.rounds == 2
    assert restored.accountant.epsilon() == pytest.approx(dp.report["epsilon"], rel=1e-12)


# (5) parameters ------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    {"noise_multiplier": -0.1}, {"noise_multiplier": float("nan")},
    {"clip_norm": 0.0}, {"clip_norm": -1.0},
    {"delta": 0.0}, {"delta": 1.0}, {"delta": -1e-5},
    {"sampling_rate": 0.0}, {"sampling_rate": 1.5},
])
def test_invalid_parameters(kw):
    with pytest.raises(ValueError):
        DPFedAvg(**{"noise_multiplier": 1.0, "clip_norm": 1.0, **kw})


def test_invalid_accountant_parameters():
    for d in (0.0, 1.0, 2.0):
        with pytest.raises(ValueError):
            PrivacyAccountant(d)
    acc = PrivacyAccountant(1e-5)
    with pytest.raises(ValueError):
        acc.step(-1.0)
    with pytest.raises(ValueError):
        acc.step(1.0, sampling_rate=0.0)
    assert acc.rounds == 0


def test_missing_accountant_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r"client-level DP needs the accountant: pip install 'fedmoe\[dp\]'"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0)


# (6) no results ------------------------------------------------------------------


def test_empty_results_change_nothing():
    g = {"backbone.w": torch.randn(5), "expert.0.0.w": torch.randn(2, 2)}
    g0 = clone(g)
    dp = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, seed=0)
    out = dp.aggregate(1, g, [], [])
    assert all(torch.equal(out[k], g0[k]) for k in g) and all(torch.equal(g[k], g0[k]) for k in g)
    assert dp.accountant.rounds == 0 and dp.report["epsilon"] == 0.0 and dp.report["rounds"] == 0
    assert dp.state_dict() == {"steps": []}
