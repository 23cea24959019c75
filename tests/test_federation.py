"""A tiny federation end to end, through real brokers (Mosquitto and embedded amqtt)."""

import time

import numpy as np
import pytest

from moe_model.shards import shards_for
from protocol.transport import Transport
from tests.federation import Federation


def check_load_metrics(records):
    """Each record's ``cv`` / ``max_min_gap`` are eq. 8-9 of the expert load summed over
    rounds 1..r (the aggregator's window is the whole run), averaged over layers: recomputed
    here from the records' own per-round ``expert_load``, which must be non-zero."""
    total = {}
    for r in records:
        assert r["expert_load"] and all(sum(w) > 0 for w in r["expert_load"].values()), r["expert_load"]
        for layer, w in r["expert_load"].items():
            total[layer] = total.get(layer, 0) + np.asarray(w, dtype=np.float64)
        assert r["cv"] == pytest.approx(np.mean([w.std() / w.mean() for w in total.values()]))
        assert r["max_min_gap"] == pytest.approx(np.mean([w.max() - w.min() for w in total.values()]))
    assigned = {}
    for r in records:  # the same over the assigned data volume: sum of the holders' samples per expert
        for v in r["devices"].values():
            for layer, ids in v["experts"].items():
                a = assigned.setdefault(layer, np.zeros(len(r["expert_load"][layer])))
                a[ids] += v["samples"]
        assert r["assigned_cv"] == pytest.approx(np.mean([a.std() / a.mean() for a in assigned.values()]))


def check_records(records, fed):
    assert [r["round"] for r in records] == list(range(1, fed.rounds + 1))
    assert all(r["status"] == "ok" and r["accuracy"] is not None for r in records)
    assert fed.aggregator.initial["accuracy"] is not None
    check_load_metrics(records)
    for r in records:
        assert set(r["devices"]) == {"dev0", "dev1"}
        assert len(r["expert_load"]["1"]) == 4
        for d, v in r["devices"].items():
            held = {int(k): e for k, e in v["experts"].items()}
            # a device never receives a shard it was not assigned
            assert set(v["shards_fetched"]) <= set(shards_for(held)), (d, v)
            assert v["bytes_up"] > 0 and v["bytes_down"] > 0 and v["peak_rss_bytes"] > 0
            # the footprint (what the budget is held against) excludes file pages; RSS includes them
            assert 0 < v["peak_footprint_bytes"] == v["peak_bytes"] < v["peak_rss_bytes"]
    first, second = records[0]["devices"], records[1]["devices"]
    for d in first:
        assert sorted(first[d]["shards_fetched"]) == sorted(shards_for({int(k): e for k, e in first[d]["experts"].items()}))
        if first[d]["experts"] == second[d]["experts"]:
            assert second[d]["shards_fetched"] == []
            assert second[d]["bytes_down"] < 0.1 * first[d]["bytes_down"]
    # heterogeneous budgets -> different numbers of experts
    sizes = [len(first[f"dev{i}"]["experts"]["1"]) for i in range(2)]
    assert sizes == list(fed.experts)


def retained_shards(url, federation, protocol):
    t = Transport(url, protocol=protocol).connect()
    t.subscribe(f"fl/v1/{federation}/shards/#")
    time.sleep(1.0)
    n = t.inbox.qsize()
    t.close()
    return n


@pytest.mark.slow
def test_federation_over_mosquitto(mosquitto_url, tmp_path):
    fed = Federation(mosquitto_url, str(tmp_path), experts=(2, 4))
    records = fed.run()
    check_records(records, fed)
    assert fed.clients[0].transport.v5  # Mosquitto speaks MQTT 5
    assert retained_shards(mosquitto_url, fed.federation, "auto") == 0  # cleaned up


@pytest.mark.slow
def test_federation_over_embedded_broker(embedded_url, tmp_path):
    fed = Federation(embedded_url, str(tmp_path), protocol="3.1.1", experts=(1, 4))
    check_records(fed.run(), fed)


@pytest.mark.slow
def test_full_moe_baseline_everyone_holds_everything(mosquitto_url, tmp_path):
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(4, 4), assignment="full")
    (rec,) = fed.run()
    assert all(v["experts"] == {"1": [0, 1, 2, 3]} for v in rec["devices"].values())


@pytest.mark.slow
def test_no_assignable_device_fails_clearly_instead_of_waiting(mosquitto_url, tmp_path):
    """`full` needs every expert; devices whose budgets hold 2 of 4 can never be assigned:
    the aggregator stops after start_timeout_s with a TimeoutError that says so, and the
    devices, which never got a stop command, are stopped and disconnected (a client left
    running kept pytest from exiting on CI)."""
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2, 2), assignment="full",
                     config_kw={"start_timeout_s": 3})
    with pytest.raises(AssertionError) as e:
        fed.run(timeout=60)
    assert any(isinstance(x, TimeoutError) and "no device could be assigned" in str(x) for x in fed.errors), e.value
    assert fed.records == []
    assert fed.clients and not any(c.transport.connected for c in fed.clients)


@pytest.mark.parametrize("broker", ["mosquitto", "embedded"])
def test_a_client_gets_no_retained_message_it_did_not_subscribe_to(broker, request):
    """amqtt 0.12.1 sends a connecting client the retained messages matching *other*
    clients' subscriptions; the transport drops them (counted), so a client's inbox holds
    only what it subscribed to, on either broker."""
    import uuid

    url = request.getfixturevalue(f"{broker}_url")
    proto = "3.1.1" if broker == "embedded" else "auto"
    base = f"test/{uuid.uuid4().hex[:8]}"
    other, pub = Transport(url, protocol=proto).connect(), Transport(url, protocol=proto).connect()
    try:
        assert other.subscribe(f"{base}/+/status", timeout=10) is True
        pub.publish(f"{base}/dev0/status", b"offline", retain=True)
        assert other.get(10).payload == b"offline"
        sub = Transport(url, protocol=proto).connect()
        try:
            assert sub.subscribe(f"{base}/mine", timeout=10) is True
            pub.publish(f"{base}/mine", b"hi")
            m = sub.get(10)
            assert m is not None and (m.topic, m.payload) == (f"{base}/mine", b"hi")
            assert sub.get(0.5) is None
            # amqtt also sends the retained messages other tests left on this session's broker
            assert sub.unsolicited >= 1 if broker == "embedded" else sub.unsolicited == 0
        finally:
            sub.close()
    finally:
        pub.publish(f"{base}/dev0/status", b"", retain=True)  # clear the retained message
        other.close()
        pub.close()


@pytest.mark.parametrize("broker", ["mosquitto", "embedded"])
def test_subscribe_can_wait_for_the_suback(broker, request):
    """With a timeout, subscribe() returns once the broker acknowledged it, so a message
    published right after is delivered; unconnected, it reports False (and subscribes on
    connect)."""
    import uuid

    url = request.getfixturevalue(f"{broker}_url")
    proto = "3.1.1" if broker == "embedded" else "auto"
    topic = f"test/{uuid.uuid4().hex[:8]}/x"
    assert Transport(url, protocol=proto).subscribe(topic, timeout=0.5) is False
    sub, pub = Transport(url, protocol=proto).connect(), Transport(url, protocol=proto).connect()
    try:
        assert sub.subscribe(topic, timeout=10) is True
        pub.publish(topic, b"hi")
        m = sub.get(10)
        assert m is not None and m.payload == b"hi"
    finally:
        sub.close()
        pub.close()
