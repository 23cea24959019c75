"""The ``fixed`` assignment (every device the same experts; Fed-MoE's baselines,
Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610 Sec. 5.1) and the cloud's evaluation of that common sub-MoE."""

from __future__ import annotations

import pytest
import torch

from cloud.assignment import get_assignment
from cloud.global_model import GlobalModel
from cloud.strategies import get_strategy
from cloud.strategy import DeviceView, Setup
from moe_model.submoe import SubMoE
from moe_model.shards import decode_shard, shards_for
from moe_model.train import evaluate
from protocol.messages import TrainConfig
from tests.conftest import tiny_spec


def _views(*caps):
    return [DeviceView(f"d{i}", "t", 10, 2**30, c) for i, c in enumerate(caps)]


def test_every_device_gets_the_same_experts_and_a_too_small_one_is_excluded_with_the_reason():
    a = get_assignment("fixed")([1, 3], 8, experts=[1, 0])
    plan = a.configure(1, _views(8, 2, 1))
    assert plan.assignments == {"d0": {1: [0, 1], 3: [0, 1]}, "d1": {1: [0, 1], 3: [0, 1]}}
    assert set(plan.excluded) == {"d2"} and "gives 2 experts per layer; its budget holds 1" in plan.excluded["d2"]
    assert a.served_experts() == {1: [0, 1], 3: [0, 1]}
    assert get_assignment("fixed")([1], 8).configure(1, _views(1)).assignments == {"d0": {1: [0]}}  # default [0]


@pytest.mark.parametrize("bad", [[], [0, 0], [8], [-1], [True], "0", None])
def test_bad_expert_lists_are_refused(bad):
    with pytest.raises(ValueError, match="distinct ids in 0..7"):
        get_assignment("fixed")([1], 8, experts=bad)


def test_the_cloud_evaluates_the_common_sub_moe_not_the_whole_moe():
    spec = tiny_spec()
    model = GlobalModel(spec, {"t": ["a", "b"]}, "fp32")
    gen = torch.Generator().manual_seed(0)
    model.set_state({k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in model.state.items()})
    items = [(f"text {i} about {'markets' if i % 2 else 'football'}", i % 2) for i in range(16)]
    setup = Setup(model.layers, spec.num_experts, 0, TrainConfig(), {"t": ["a", "b"]},
                  assignment=("fixed", {"experts": [0]}))
    strategy = get_strategy("composed")(setup)
    assert strategy.evaluated_experts(model) == {model.layers[0]: [0]}
    got = strategy.evaluate(1, model, {"t": items})["per_task"]["t"]
    compact = {model.layers[0]: [0]}
    net = SubMoE(spec, compact, "t", 2, {sid: decode_shard(model.shard_bytes[sid]) for sid in shards_for(compact)})
    net.load_adapter_state(model.state_for(compact, "t"))
    want = evaluate(net, items, 32)
    assert got["loss"] == pytest.approx(want.loss, rel=1e-5) and got["accuracy"] == want.accuracy
    whole = get_strategy("composed")(Setup(model.layers, spec.num_experts, 0, TrainConfig(), {"t": ["a", "b"]}))
    assert whole.evaluated_experts(model) is None
    assert whole.evaluate(1, model, {"t": items})["per_task"]["t"]["loss"] != pytest.approx(want.loss, rel=1e-5)
