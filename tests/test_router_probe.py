"""FedMoE's own p (``own_p``): the device-side ``router_probe`` term measures activation
probabilities over every expert, the cloud completes its inputs, and the assignment searches a
device's sub-model from its own report."""

from types import SimpleNamespace

import pytest
import torch

from cloud.assignment import get_assignment
from cloud.assignment.fedmoe import own_probs
from cloud.strategies.composed import with_router_rows
from cloud.strategy import ClientResult, DeviceView, Plan
from edge_sdk.objectives import terms_for
from edge_sdk.objectives.router_probe import ROWS
from moe_model.models.moe import moe_blocks
from moe_model.stats import ActivationStats
from moe_model.submoe import SubMoE
from moe_model.train import evaluate
from protocol import keys
from protocol.messages import Objective, TrainConfig
from tests.conftest import tiny_spec

TEXTS = [("the market fell as shares in banks dropped", 0), ("a film star won an award last night", 1),
         ("the minister said the election would be close", 0), ("def main(): return 0 if x else 1", 1)] * 3


def _model(experts):
    torch.manual_seed(0)
    return SubMoE(tiny_spec(), {1: experts}, "t", 2, None)


def _probe(model, rows, top_k=2):
    (term,) = terms_for(TrainConfig(batch_size=4), [Objective(name="router_probe", params={"top_k": top_k})], {},
                        {ROWS: rows}, val_items=TEXTS)
    term.before_training(model)
    return term.statistics()


def test_on_the_full_moe_it_equals_the_validation_activation_probabilities():
    model = _model([0, 1, 2, 3])
    block = moe_blocks(model.model)[1]
    rows = block.router.weight().detach()[None]  # (1 layer, 4 experts, H)
    stats = ActivationStats(moe_blocks(model.model), num_experts=4)
    evaluate(model, TEXTS, 4, stats)
    (ls,) = stats.layer_stats()
    p = _probe(model, rows)["p.1"]
    assert p == pytest.approx(ls.activation_prob, abs=1e-9) and sum(p) == pytest.approx(2.0)


def test_a_device_holding_two_experts_scores_all_four_and_its_model_is_unchanged():
    model = _model([0, 2])
    before = {k: v.clone() for k, v in model.trainable().items()}
    v = torch.randn(32, generator=torch.Generator().manual_seed(1))
    rows = torch.zeros(1, 4, 32)
    rows[0, 3], rows[0, 1] = v, -v  # top-1: expert 3 where h.v > 0, expert 1 where h.v < 0 (neither held)
    p = _probe(model, rows, top_k=1)["p.1"]
    assert p[0] == p[2] == 0 and p[1] + p[3] == pytest.approx(1.0) and p[3] > 0
    assert all(torch.equal(v, before[k]) for k, v in model.trainable().items())


def test_the_term_refuses_missing_or_misshapen_rows():
    with pytest.raises(ValueError, match="router_probe.rows"):
        terms_for(TrainConfig(), [Objective(name="router_probe", params={"top_k": 2})], {}, {})
    with pytest.raises(ValueError, match="top_k"):
        _probe(_model([0, 1]), torch.zeros(1, 4, 32), top_k=5)
    with pytest.raises(ValueError, match="MoE layers"):
        _probe(_model([0, 1]), torch.zeros(2, 4, 32))


def test_the_cloud_completes_the_term_with_every_router_row():
    state = {keys.router_key(layer, e): torch.full((3,), 10.0 * layer + e) for layer in (3, 1) for e in range(2)}
    model = SimpleNamespace(spec=SimpleNamespace(num_experts=2, top_k=4), layers=[3, 1], state=state)
    plan = Plan({"a": {1: [0], 3: [1]}, "b": {1: [1], 3: [0]}}, objectives={"a": [Objective(name="router_probe")]})
    out = with_router_rows(plan, model)
    rows = out.tensors["a"][ROWS]
    assert rows.shape == (2, 2, 3) and rows[1, 0, 0] == 30 and rows[0, 1, 0] == 11  # layers ascending
    assert out.objectives["a"][0].params == {"top_k": 2} and "b" not in out.tensors


def _cost(ex):
    return 10 * sum(len(v) for v in ex.values())


def _result(d, experts, p, extras=None):
    stats = SimpleNamespace(layers=[SimpleNamespace(layer=1, activation_prob=p)], val_accuracy=0.5,
                            extras=extras or {})
    return ClientResult(d, "bbc", 100, experts, {}, stats)


@pytest.mark.parametrize("report, expect", [
    ([0.0, 0.9, 0.1, 1.0], ("own", [1, 3])),  # its own p: experts 1 and 3
    ([0.0, float("nan"), 0.1, 1.0], ("estimated", [2, 3])),  # out of bounds: ignored, big's probe p instead
    ([0.0, 3.0, 0.1, 3.0], ("estimated", [2, 3])),  # sums above E
    ([0.0, 2.5, 0.0, 0.0], ("estimated", [2, 3])),  # one share above 1: no token counts twice for an expert
])
def test_fedmoe_searches_a_small_device_from_its_own_report(report, expect):
    s = get_assignment("fedmoe")([1], 4, alpha=0.8, probe_steps=3, own_p=True)
    big, small = DeviceView("big", "bbc", 100, 40, 4, _cost), DeviceView("small", "bbc", 100, 25, 2, _cost)
    plan = s.configure(1, [big, small])
    assert "big" not in plan.objectives and [o.name for o in plan.objectives["small"]] == ["router_probe"]
    s.observe(1, [_result("big", plan.assignments["big"], [0.1, 0.2, 0.6, 0.3]),
                  _result("small", plan.assignments["small"], [0.5, 0.5, 0, 0], {"router_probe.p.1": report})], [])
    plan2 = s.configure(2, [big, small])
    how, experts = expect
    assert plan2.info["searched"]["small"]["p"] == how and plan2.assignments["small"] == {1: experts}
    restored = get_assignment("fedmoe")([1], 4, own_p=True)
    restored.load_state_dict(s.state_dict())
    assert restored.configure(3, [big, small]).assignments == plan2.assignments


def test_without_own_p_or_for_an_older_device_nothing_is_asked():
    small = DeviceView("small", "bbc", 100, 25, 2, _cost)
    assert not get_assignment("fedmoe")([1], 4).configure(1, [small]).objectives
    old = DeviceView("old", "bbc", 100, 25, 2, _cost, protocol_minor=10)
    assert not get_assignment("fedmoe")([1], 4, own_p=True).configure(1, [old]).objectives


def test_own_p_must_be_a_boolean():
    with pytest.raises(ValueError, match="own_p must be true or false"):
        get_assignment("fedmoe")([1], 4, own_p="false")


def test_own_probs_bounds():
    assert own_probs({"router_probe.p.1": [1, 1]}, [1], 2) == {1: [1.0, 1.0]}
    assert own_probs({"router_probe.p.1": [1, 1]}, [1, 3], 2) is None  # a layer missing
    assert own_probs({"router_probe.p.1": [0, 0]}, [1], 2) is None
    assert own_probs({"router_probe.p.1": [-0.1, 1]}, [1], 2) is None
    assert own_probs({"router_probe.p.1": [1.5, 0]}, [1], 2) is None
    assert own_probs({"router_probe.p.1": [1, 1, 0]}, [1], 2) is None
