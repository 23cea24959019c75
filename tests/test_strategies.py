"""Assignment and aggregation strategies, metrics and data partitions."""

import pytest
import torch

from cloud.aggregation import get_aggregation
from cloud.assignment import get_assignment
from cloud.metrics import LoadWindow, coefficient_of_variation, max_min_gap, round_load
from cloud.strategy import ClientResult, DeviceView
from fedmoe.partition import parse_partition, partition


def view(d, cap, task="bbc"):
    return DeviceView(d, task, 100, 2**30, cap)


def result(d, experts, state, n=10, task="bbc"):
    return ClientResult(d, task, n, experts, state, stats=None)


def test_random_kept_nested_over_many_devices():
    s = get_assignment("random_kept")([0], 64, seed=3)
    for d in range(20):
        small, big = (s.configure(1, [view(f"d{d}", k)]).assignments[f"d{d}"][0] for k in (10, 40))
        assert set(small) < set(big)


def test_random_kept_sizes_sticky_and_seeded():
    s = get_assignment("random_kept")([1, 3], 8, seed=7)
    p1 = s.configure(1, [view("a", 3), view("b", 8), view("c", 0)]).assignments
    assert set(p1) == {"a", "b"}  # capacity 0 cannot train
    assert all(len(v) == 3 for v in p1["a"].values()) and p1["b"] == {1: list(range(8)), 3: list(range(8))}
    p2 = s.configure(2, [view("a", 3)]).assignments
    assert p2["a"] == p1["a"]  # kept while capacity is unchanged
    p3 = s.configure(3, [view("a", 2)]).assignments
    assert all(len(v) == 2 for v in p3["a"].values())
    p4 = s.configure(4, [view("a", 6)]).assignments
    for layer in (1, 3):  # nested: a shrink keeps a subset, a growth keeps everything (shards stay cached)
        assert set(p3["a"][layer]) <= set(p1["a"][layer]) <= set(p4["a"][layer])
    again = get_assignment("random_kept")([1, 3], 8, seed=7).configure(1, [view("a", 3)]).assignments
    assert again["a"] == p1["a"]


def test_full_assigns_everything_and_leaves_out_small_budgets():
    s = get_assignment("full")([1], 4)
    plan = s.configure(1, [view("a", 4), view("b", 2)])
    assert plan.assignments == {"a": {1: [0, 1, 2, 3]}} and plan.info["left_out_budget"] == ["b"]


def test_unknown_strategy_names_known_ones():
    with pytest.raises(KeyError, match="random_kept"):
        get_assignment("nope")
    with pytest.raises(KeyError, match="modular"):
        get_aggregation("nope")


@pytest.mark.parametrize("lookup,old,new", [
    (get_assignment, "random", "random_redraw"),
    (get_assignment, "random_moe", "random_kept"),
    (get_assignment, "randommoe", "random_same_size"),
    (get_aggregation, "fedmoe", "modular"),
])
def test_former_names_select_the_renamed_strategy(lookup, old, new):
    """Configs written before the renames (and the committed benchmarks) still work: the
    old name is an alias of exactly the class now registered under the new name."""
    cls = lookup(new)
    assert lookup(old) is cls and cls.name == new and cls.aliases == (old,)


def test_aliases_are_not_inherited():
    # random_redraw subclasses random_kept; each keeps its own former name
    assert get_assignment("random_moe") is not get_assignment("random_redraw")
    assert get_assignment("random_moe") is get_assignment("random_kept")
    # the ``fedmoe`` aggregation alias does not touch the ``fedmoe`` assignment (another family)
    assert get_assignment("fedmoe").name == "fedmoe" and get_assignment("fedmoe") is not get_aggregation("fedmoe")


def test_modular_aggregation_hand_computed():
    g = {"expert.1.0.fc1.lora_B": torch.zeros(2), "expert.1.1.fc1.lora_B": torch.zeros(2),
         "expert.1.2.fc1.lora_B": torch.full((2,), 9.0), "router.1.0": torch.zeros(2), "router.1.1": torch.zeros(2),
         "router.1.2": torch.zeros(2), "backbone.q.lora_B": torch.zeros(2), "head.bbc.weight": torch.zeros(2),
         "head.tweets.weight": torch.full((2,), 5.0)}
    a = result("a", {1: [0, 1]}, {"expert.1.0.fc1.lora_B": torch.ones(2), "expert.1.1.fc1.lora_B": torch.ones(2),
                                  "router.1.0": torch.ones(2), "router.1.1": torch.ones(2),
                                  "backbone.q.lora_B": torch.ones(2), "head.bbc.weight": torch.ones(2)}, n=10)
    b = result("b", {1: [1]}, {"expert.1.1.fc1.lora_B": torch.full((2,), 4.0), "router.1.1": torch.full((2,), 4.0),
                               "backbone.q.lora_B": torch.full((2,), 4.0), "head.bbc.weight": torch.full((2,), 4.0)},
               n=30)
    out = get_aggregation("modular")().aggregate(1, g, [a, b], [])
    assert torch.equal(out["expert.1.0.fc1.lora_B"], torch.ones(2))          # one holder: taken as is
    assert torch.allclose(out["expert.1.1.fc1.lora_B"], torch.full((2,), (10 + 120) / 40))  # |D_c| weighted
    assert torch.allclose(out["router.1.1"], torch.full((2,), 3.25))       # router rows follow their expert
    assert torch.equal(out["expert.1.2.fc1.lora_B"], torch.full((2,), 9.0))  # no holder: unchanged
    assert torch.allclose(out["backbone.q.lora_B"], torch.full((2,), 3.25))
    assert torch.equal(out["head.tweets.weight"], torch.full((2,), 5.0))   # other task's head untouched


def test_cv_and_gap_on_known_load():
    assert coefficient_of_variation([10, 10, 10, 10]) == 0
    assert coefficient_of_variation([0, 0]) == 0
    assert abs(coefficient_of_variation([1, 3]) - 0.5) < 1e-12  # std 1, mean 2
    assert max_min_gap([5, 1, 9]) == 8
    w = LoadWindow([1], 3)
    w.add({1: [1, 0, 1]})
    w.add({1: [1, 2, 1]})
    assert w.totals() == {1: [2, 2, 2]} and w.summary()["cv"] == 0
    assert round_load([{1: [1, 2, 3]}, {1: [1, 0, 0], 5: [9, 9, 9]}], [1], 3) == {1: [2, 2, 3]}


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "dirichlet:0.1", "classes:2"])
def test_partitions_cover_each_sample_once(scheme):
    labels = [i % 5 for i in range(1000)]
    parts = partition(labels, 6, scheme, seed=1)
    flat = sorted(i for p in parts for i in p)
    assert flat == sorted(set(flat)) and len(parts) == 6
    if scheme != "classes:2":
        assert flat == list(range(1000))
    if scheme == "classes:2":
        assert all(len({labels[i] for i in p}) <= 2 for p in parts)
    assert parts == partition(labels, 6, scheme, seed=1)


def test_dirichlet_is_skewed_and_iid_is_not():
    labels = [i % 5 for i in range(2000)]

    def skew(parts):
        import numpy as np
        return np.mean([max(np.bincount([labels[i] for i in p], minlength=5)) / len(p) for p in parts])

    assert skew(partition(labels, 6, "dirichlet:0.1", 0)) > skew(partition(labels, 6, "iid", 0)) + 0.2
    with pytest.raises(ValueError):
        parse_partition("zipf:2")


def test_an_infeasible_dirichlet_partition_says_what_to_change():
    labels = [i % 5 for i in range(1747)]  # BBC's training texts over 100 devices: ~17 each, too few for Dir(0.5)
    with pytest.raises(ValueError, match=r"1747 samples over 100 clients with at least 10 .*fewer clients"):
        partition(labels, 100, "dirichlet:0.5", seed=0)
    assert min(len(p) for p in partition(labels, 10, "dirichlet:0.5", seed=0)) >= 10
