"""The usage-aware FLEX pieces (issue 15): the device's Switch load-balancing term, the
strategy-level ``objectives`` parameter that sends it, and ``flex_usage`` end to end."""

from __future__ import annotations

import pytest
import torch

from cloud.service import StrategyConfig
from cloud.strategies import get_strategy
from cloud.strategy import Setup
from edge_sdk.objectives.load_balance import balance_loss
from protocol.messages import Objective, TrainConfig
from tests.federation import Federation
from tests.test_federation import check_load_metrics


def test_balance_loss_is_one_when_balanced_and_n_times_the_mass_when_collapsed():
    n = 4
    uniform = torch.full((8, n), 1 / n)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(balance_loss(uniform, balanced)) == pytest.approx(1.0)
    # every token routed to experts 0 and 1 with probability 0.5 each: f = (0.5, 0.5, 0, 0), P = (0.5, 0.5, 0, 0)
    collapsed = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8, requires_grad=True)
    loss = balance_loss(collapsed, torch.tensor([[0, 1]] * 8))
    assert loss.item() == pytest.approx(n * (0.5 * 0.5 + 0.5 * 0.5))
    loss.backward()  # the gradient reaches the probabilities of the over-used experts only
    assert collapsed.grad[0].tolist() == pytest.approx([n * 0.5 / 8, n * 0.5 / 8, 0.0, 0.0])
    assert float(balance_loss(torch.zeros(0, n), torch.zeros(0, 2, dtype=torch.long))) == 0.0


def _setup():
    return Setup([1], 4, 0, TrainConfig(), {"t": ["a", "b"]})


def test_strategy_objectives_are_validated_when_the_strategy_is_built():
    s = get_strategy("composed")(_setup(), objectives=[{"name": "load_balance", "params": {"alpha": 0.1}}])
    assert s.objectives == [Objective(name="load_balance", params={"alpha": 0.1})]
    with pytest.raises(ValueError, match="unknown objective term 'nope'.*load_balance"):
        get_strategy("composed")(_setup(), objectives=[{"name": "nope"}])
    with pytest.raises(ValueError, match="must be a list"):
        get_strategy("composed")(_setup(), objectives={"name": "load_balance"})
    with pytest.raises(ValueError, match="objectives"):
        get_strategy("composed")(_setup(), objectives=[{"params": {}}])


@pytest.mark.slow
def test_flex_usage_with_the_balance_term_end_to_end(embedded_url, tmp_path):
    """Every device trains with the term (its statistic comes back in the record), the
    records carry the usage and the assigned-volume CV, and flex_usage's deficit is the
    reported usage's (not the assigned volume's)."""
    fed = Federation(embedded_url, str(tmp_path), protocol="3.1.1", rounds=2, experts=(2, 3), config_kw={
        "strategy": StrategyConfig(name="composed", params={
            "objectives": [{"name": "load_balance", "params": {"alpha": 0.05}}]}),
        "assignment": StrategyConfig(name="flex_usage", params={"solver": "highs"}),
        "aggregation": StrategyConfig(name="usage_weighted"),
        "train": TrainConfig(max_steps=3, batch_size=8, router="private"),
    })
    records = fed.run()
    assert [r["status"] for r in records] == ["ok", "ok"]
    check_load_metrics(records)
    for r in records:
        for d, v in r["devices"].items():
            aux = v["extras"]["load_balance.aux"]
            assert len(aux) == 1 and 1 - 1e-6 <= aux[0] <= 3.0, (d, aux)  # n * sum f P: 1 balanced, n collapsed
    lb = fed.aggregator.engine.strategy.assignment.loads[1]
    usage = torch.tensor(records[-1]["expert_load"]["1"], dtype=torch.float64)
    assert lb.last_load is not None
    assert torch.allclose(torch.as_tensor(lb.last_load), usage * lb.last_load.sum() / usage.sum())
