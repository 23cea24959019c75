"""Robust aggregation rules (cloud/robust/rules/) on small hand-made adapter states."""

from __future__ import annotations

import json

import pytest
import torch

from cloud.aggregation.base import AggregationStrategy
from cloud.aggregation.modular import Modular
from cloud.robust.rules import RobustAggregation, krum_scores, median, squared_distances, trimmed_mean
from cloud.strategy import ClientResult

SHAPES = {
    "backbone.l0.lora_A": (2, 3),
    "expert.0.1.fc1.lora_B": (3, 2),
    "router.0.1": (4,),
    "head.bbc.weight": (5, 4),
    "expert.0.2.fc1.lora_B": (3, 2),
    "router.0.2": (4,),
    "expert.0.3.fc1.lora_B": (3, 2),  # held by nobody
    "router.0.3": (4,),
}
UNIT_01 = ("expert.0.1.fc1.lora_B", "router.0.1")
UNIT_02 = ("expert.0.2.fc1.lora_B", "router.0.2")
UNIT_03 = ("expert.0.3.fc1.lora_B", "router.0.3")

RULES = ("median", "trimmed_mean", "multi_krum")
"""The built-in rules."""


def global_state(dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {k: torch.full(s, -7.0, dtype=dtype) for k, s in SHAPES.items()}


def pattern(shape) -> torch.Tensor:
    """Distinct small values per coordinate, so coordinate mix-ups show."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float64).reshape(shape) / 100


def result(device: str, n: int, value: float, extra_units=(), dtype=torch.float32) -> ClientResult:
    """A bbc device holding the backbone, its head, expert (0,1) and ``extra_units``;
    every tensor is ``pattern + value``."""
    names = ["backbone.l0.lora_A", "head.bbc.weight", *UNIT_01] + [k for u in extra_units for k in u]
    state = {k: (pattern(SHAPES[k]) + value).to(dtype) for k in names}
    experts = {0: sorted([1] + [int(u[0].split(".")[2]) for u in extra_units])}
    return ClientResult(device, "bbc", n, experts=experts, state=state, stats=None)


def expected(value: float, name: str) -> torch.Tensor:
    return (pattern(SHAPES[name]) + value).to(torch.float32)


HELD = ["backbone.l0.lora_A", "head.bbc.weight", *UNIT_01]


def test_median_ignores_one_huge_outlier_and_plain_modular_does_not():
    gs = global_state()
    rs = [result("a", 10, 1.0), result("b", 20, 2.0), result("c", 30, 3.0), result("d", 40, 4.0),
          result("evil", 1000, 1e6)]
    out = RobustAggregation(Modular(), "median").aggregate(1, gs, rs, [])
    for k in HELD:
        torch.testing.assert_close(out[k], expected(3.0, k), rtol=0, atol=1e-6)  # median of 1,2,3,4,1e6
    plain = Modular().aggregate(1, gs, rs, [])
    assert (plain["backbone.l0.lora_A"] - expected(3.0, "backbone.l0.lora_A")).abs().min() > 1e5


def test_median_is_coordinate_wise_with_even_n_quantile_semantics():
    g = torch.Generator().manual_seed(0)
    gs = global_state()
    rs = []
    for i in range(4):
        r = result(f"d{i}", 10 * (i + 1), 0.0)
        r.state = {k: torch.randn(SHAPES[k], generator=g) for k in r.state}
        rs.append(r)
    out = RobustAggregation(Modular(), "median").aggregate(1, gs, rs, [])
    for k in HELD:
        stacked = torch.stack([r.state[k].double() for r in rs])
        want = torch.quantile(stacked, 0.5, dim=0).float()
        torch.testing.assert_close(out[k], want, rtol=0, atol=1e-7)
        # even n: the mean of the two middle values, which differs from both of them
        assert not any(torch.equal(out[k], r.state[k]) for r in rs)


def test_median_helpers_hand_computed():
    x = torch.tensor([[5.0, 1.0], [1.0, 2.0], [3.0, 100.0], [2.0, -4.0]], dtype=torch.float64)
    assert median(x).tolist() == [2.5, 1.5]
    assert median(x[:3]).tolist() == [3.0, 2.0]
    nan = float("nan")  # a minority of NaN coordinates counts as the largest values: it never reaches the median
    w = torch.tensor([[nan, 1.0], [1.0, nan], [3.0, 2.0], [2.0, 4.0], [9.0, 0.0]], dtype=torch.float64)
    assert median(w).tolist() == [3.0, 2.0] and median(w[:4]).tolist() == [2.5, 3.0]
    # trim 0.2 of 5 values: k = 1 from each end
    y = torch.tensor([[0.0], [1.0], [2.0], [6.0], [1e6]], dtype=torch.float64)
    assert trimmed_mean(y, 0.2).tolist() == [3.0]  # mean(1, 2, 6)
    assert trimmed_mean(y, 0.0).tolist() == [3.0]  # at least one dropped from each end
    assert trimmed_mean(y, 0.4).tolist() == [2.0]  # k = 2: only the median is left
    z = torch.arange(10, dtype=torch.float64).reshape(10, 1) ** 2  # 0,1,4,...,81
    assert trimmed_mean(z, 0.25).tolist() == [sum(v * v for v in range(2, 8)) / 6]  # k = 2


def test_trimmed_mean_hand_computed():
    gs = global_state()
    rs = [result("a", 10, 0.0), result("b", 20, 1.0), result("c", 30, 2.0), result("d", 40, 6.0),
          result("evil", 50, 1e6)]
    agg = RobustAggregation(Modular(), "trimmed_mean", trim=0.2)
    out = agg.aggregate(1, gs, rs, [])
    for k in HELD:
        torch.testing.assert_close(out[k], expected(3.0, k), rtol=0, atol=1e-6)  # mean of 1, 2, 6
    assert agg.report["robust_units"] == 3 and agg.report["dropped"] == {}


def test_multi_krum_drops_the_outlier_and_keeps_inner_weights():
    gs = global_state()
    honest = [result("a", 10, 1.0), result("b", 20, 1.1), result("c", 30, 0.9), result("d", 40, 1.05)]
    rs = honest + [result("evil", 1000, 100.0)]
    agg = RobustAggregation(Modular(), "multi_krum", f=1)
    out = agg.aggregate(3, gs, rs, [])
    assert agg.report["dropped"] == {"evil": 3}  # backbone, head bbc, expert (0,1)
    assert agg.report["robust_units"] == 3 and agg.report["min_holders"] == 5
    mean = (10 * 1.0 + 20 * 1.1 + 30 * 0.9 + 40 * 1.05) / 100  # |D_c|-weighted, not the plain mean 1.0125
    for k in HELD:
        torch.testing.assert_close(out[k], expected(mean, k), rtol=0, atol=1e-6)
    json.dumps(agg.report)


def test_multi_krum_m_selects_the_m_most_central():
    gs = global_state()
    rs = [result("a", 10, 1.0), result("b", 20, 1.1), result("c", 30, 0.9), result("d", 40, 1.5),
          result("evil", 1000, 100.0)]
    agg = RobustAggregation(Modular(), "multi_krum", f=1, m=3)
    out = agg.aggregate(1, gs, rs, [])
    assert agg.report["dropped"] == {"d": 3, "evil": 3}
    mean = (10 * 1.0 + 20 * 1.1 + 30 * 0.9) / 60
    torch.testing.assert_close(out["router.0.1"], expected(mean, "router.0.1"), rtol=0, atol=1e-6)


def test_squared_distances_match_pairwise_differences_far_from_the_origin():
    # points close together far from the origin: the Gram-matrix form without centring would
    # cancel most of its digits here (|x|^2 ~ 1e6, distances^2 ~ 1e-4)
    g = torch.Generator().manual_seed(0)
    centre = torch.randn(500, generator=g, dtype=torch.float64) * 50
    flat = centre + 1e-3 * torch.randn(40, 500, generator=g, dtype=torch.float64)
    direct = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist").pow(2)
    got = squared_distances(flat)
    torch.testing.assert_close(got, direct, rtol=1e-9, atol=1e-12 * float(direct.max()))
    assert torch.equal(got.diagonal(), torch.zeros(40, dtype=torch.float64))


def test_krum_scores_of_non_finite_rows_are_infinite_and_the_others_are_not_spoiled():
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(8, 30, generator=g, dtype=torch.float64)
    flat[6, 3], flat[7, 0] = float("nan"), float("inf")
    scores = krum_scores(flat, f=1)
    assert torch.isinf(scores[6:]).all() and torch.isfinite(scores[:6]).all()
    # n - f - 2 = 5 nearest of 7 others: the two bad rows sort last, so the six clean rows score
    # as the sum of their 5 nearest clean neighbours, which is every other clean row
    d2 = torch.cdist(flat[:6], flat[:6]).pow(2)
    torch.testing.assert_close(scores[:6], d2.sum(dim=1))


def test_multi_krum_needs_2f_plus_3_holders():
    gs = global_state()
    rs = [result("a", 10, 1.0), result("b", 20, 1.1), result("c", 30, 0.9), result("evil", 1000, 100.0)]
    agg = RobustAggregation(Modular(), "multi_krum", f=1)
    out = agg.aggregate(1, gs, rs, [])
    plain = Modular().aggregate(1, gs, rs, [])
    assert agg.report["robust_units"] == 0 and agg.report["fallback_units"] == 3 and agg.report["dropped"] == {}
    for k in SHAPES:
        assert torch.equal(out[k], plain[k])


@pytest.mark.parametrize("rule", RULES)
def test_two_holders_fall_back_to_inner_and_unheld_units_stay(rule):
    gs = global_state()
    rs = [result("a", 10, 1.0, extra_units=[UNIT_02]), result("b", 30, 5.0, extra_units=[UNIT_02]),
          result("c", 20, 2.0), result("d", 40, 3.0), result("e", 50, 4.0),
          result("evil", 60, 1e6)]
    agg = RobustAggregation(Modular(), rule)
    out = agg.aggregate(1, gs, rs, [])
    plain = Modular().aggregate(1, gs, rs, [])
    for k in UNIT_02:  # 2 holders: the inner |D_c|-weighted mean, exactly
        assert torch.equal(out[k], plain[k])
        torch.testing.assert_close(out[k], expected((10 * 1.0 + 30 * 5.0) / 40, k), rtol=0, atol=1e-6)
    for k in UNIT_03:  # held by nobody
        assert torch.equal(out[k], gs[k])
    assert abs(out["backbone.l0.lora_A"].max().item()) < 10  # 6 holders: the rule applied
    assert agg.report["units"] == 4 and agg.report["robust_units"] == 3
    assert agg.report["fallback_units"] == 1 and agg.report["unheld_units"] == 1


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtype_shape_preserved_and_inputs_untouched(rule, dtype):
    gs = global_state(dtype)
    rs = [result(f"d{i}", 10 + i, float(i), extra_units=[UNIT_02], dtype=dtype) for i in range(6)]
    before_gs = {k: v.clone() for k, v in gs.items()}
    before = [{k: v.clone() for k, v in r.state.items()} for r in rs]
    out = RobustAggregation(Modular(), rule).aggregate(1, gs, rs, [])
    assert out is not gs and set(out) == set(gs)
    for k, v in out.items():
        assert v.dtype == dtype and v.shape == gs[k].shape
    assert all(torch.equal(gs[k], before_gs[k]) for k in gs)
    for r, b in zip(rs, before):
        assert set(r.state) == set(b) and all(torch.equal(r.state[k], b[k]) for k in b)


def test_empty_results_leave_the_state_unchanged():
    gs = global_state()
    agg = RobustAggregation(Modular(), "median")
    out = agg.aggregate(1, gs, [], [])
    assert out is not gs and all(torch.equal(out[k], gs[k]) for k in gs)
    assert agg.report["units"] == 0 and agg.report["unheld_units"] == 5


@pytest.mark.parametrize("rule, params, match", [
    ("mean", {}, "multi_krum"),
    ("trimmed_mean", {"trim": 0.5}, "trim"),
    ("trimmed_mean", {"trim": -0.1}, "trim"),
    ("multi_krum", {"f": -1}, "f "),
    ("multi_krum", {"m": 0}, "m "),
    ("multi_krum", {"trim": 0.1}, "unknown"),
    ("median", {"f": 1}, "unknown"),
])
def test_invalid_rule_or_params_raise(rule, params, match):
    with pytest.raises(ValueError, match=match):
        RobustAggregation(Modular(), rule, **params)


def test_label_not_registered_and_state_delegated():
    agg = RobustAggregation(Modular(), "trimmed_mean", trim=0.2)
    assert agg.label == "modular+trimmed_mean"
    assert all(AggregationStrategy.lookup(n) is not RobustAggregation for n in AggregationStrategy.registry.names())
    assert agg.state_dict() == {"inner": {}}
    agg.load_state_dict(agg.state_dict())
