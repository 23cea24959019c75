"""FedMoE end to end on a tiny model: two tasks (BBC topics, tweet sentiment) on one MoE,
stage one (probe / estimate / search) and stage two through a real (embedded) broker."""

import uuid

import pytest

from cloud.service import Aggregator, AggregatorConfig, TaskConfig
from cloud.store import Store
from edge_sdk import EdgeClient
from moe_model.budget import estimate
from fedmoe.datasets import bbc_news, tweets
from fedmoe.inprocess import run_inprocess
from protocol.messages import TrainConfig
from tests.conftest import tiny_spec


@pytest.mark.slow
@pytest.mark.parametrize("own_p", [False, True])
def test_fedmoe_two_tasks_probe_estimate_search(embedded_url, tmp_path, own_p):
    bbc, bbc_labels = bbc_news()
    tw, tw_labels = tweets()
    spec = tiny_spec()
    fed = f"test-{uuid.uuid4().hex[:8]}"
    cfg = AggregatorConfig(
        federation=fed, model=spec,
        tasks={"bbc": TaskConfig(labels=bbc_labels), "tweets": TaskConfig(labels=tw_labels)},
        rounds=3, min_devices=3, start_timeout_s=60, round_timeout_s=60,
        train=TrainConfig(max_steps=2, batch_size=8), store=f"sqlite:///{tmp_path}/agg.db",
        clear_retained_on_exit=True, protocol="3.1.1",
        assignment={"name": "fedmoe", "params": {"probe_steps": 1, "patience": 1, "own_p": own_p}},
        aggregation={"name": "modular"},
    )
    agg = Aggregator(cfg, embedded_url, eval_data={"bbc": bbc[::50][:32], "tweets": tw[::500][:32]})

    def budget(experts, labels):
        return estimate(spec, experts, 8, len(labels), runtime_bytes=0).total + 1

    devices = [("b0", bbc[1::9][:32], "bbc", budget(4, bbc_labels)),  # holds the full MoE: probes
               ("b1", bbc[2::9][:32], "bbc", budget(2, bbc_labels)),  # does not: p estimated from b0
               ("t0", tw[3::97][:32], "tweets", budget(4, tw_labels))]
    clients = [EdgeClient(embedded_url, d, data, federation=fed, budget_bytes=b, task=task,
                          cache_dir=f"{tmp_path}/cache-{d}", protocol="3.1.1", runtime_bytes=0)
               for d, data, task, b in devices]
    records, errors = run_inprocess(agg, clients, 240)
    assert not errors, errors
    assert [r["status"] for r in records] == ["ok"] * 3
    r1, r2 = records[0], records[1]
    assert sorted(r1["assignment"]["probing"]) == ["b0", "t0"]
    assert r1["devices"]["b0"]["experts"] == {"1": [0, 1, 2, 3]}
    assert r1["assignment"]["searched"]["b1"]["p"] == "provisional"
    # round 2: probed devices get searched sub-models within alpha of their budget,
    # b1 is searched again from b0's probe (same task), or with own_p from its own report of
    # round 1 (the router_probe term: p over all 4 experts, top-2 counted)
    assert r2["assignment"]["searched"]["b1"]["p"] == ("own" if own_p else "estimated")
    extras = r1["devices"]["b1"].get("extras") or {}
    assert (sum(extras.get("router_probe.p.1", [])) == pytest.approx(2.0)) if own_p else not extras
    assert r2["assignment"]["searched"]["b0"]["p"] == "probe"
    assert len(r2["devices"]["b0"]["experts"]["1"]) < 4
    for r in records:
        assert set(r["per_task"]) == {"bbc", "tweets"}
        for d, v in r["devices"].items():
            assert v["task"] == {"b0": "bbc", "b1": "bbc", "t0": "tweets"}[d]
    st = Store(f"sqlite:///{tmp_path}/agg.db")
    state = st.get_json("strategy_state")["assignment"]
    st.close()
    assert set(state["initial"]) == {"b0", "b1", "t0"} and set(state["probes"]) == {"b0", "t0"}
