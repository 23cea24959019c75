"""A downlink at QoS 0 (devices on a broker cluster) can lose an assignment or its state: the
cloud re-sends an assignment that was not acknowledged, and a device acknowledges only once
it has the state, taking the state of a re-sent copy when the first one is missing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protocol.messages import Ack, Assignment, parse_message
from tests.test_messages import hello
from tests.test_protocol_versions import assignment


def _aggregator(tmp_path, monkeypatch, broker: str = "mqtt://127.0.0.1:1", **kw):
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from tests.conftest import tiny_spec

    cfg = AggregatorConfig(federation="rs", model=tiny_spec(), tasks={"bbc": TaskConfig(labels=["a", "b"])},
                           store=f"sqlite:///{tmp_path}/agg.db", **kw)
    agg = Aggregator(cfg, broker)
    sent = []
    for name in ("publish", "publish_nowait"):
        monkeypatch.setattr(agg.transport, name, lambda topic, payload, **k: sent.append((topic, payload)))
    monkeypatch.setattr(agg.transport, "publish_many", lambda items, **k: sent.extend((t, p) for t, p, *_ in items))
    return agg, sent


def _assignments(sent) -> list[Assignment]:
    return [parse_message(p, Assignment) for t, p in sent if t.endswith("/down/assignment")]


def test_resend_is_on_for_a_cluster_url_only(tmp_path, monkeypatch):
    from cloud.config import CLUSTER_RESEND_S

    one, _ = _aggregator(tmp_path / "a", monkeypatch)
    cluster, _ = _aggregator(tmp_path / "b", monkeypatch, broker="mqtt://127.0.0.1:1,mqtt://127.0.0.1:2")
    chosen, _ = _aggregator(tmp_path / "c", monkeypatch, broker="mqtt://127.0.0.1:1,mqtt://127.0.0.1:2",
                            assignment_resend_s=0)
    assert one.engine.settings.assignment_resend_s == 0
    assert cluster.engine.settings.assignment_resend_s == CLUSTER_RESEND_S
    assert chosen.engine.settings.assignment_resend_s == 0


def test_unacknowledged_assignments_are_resent_until_acked_at_most_three_times(tmp_path, monkeypatch):
    agg, sent = _aggregator(tmp_path, monkeypatch, assignment_resend_s=60)
    for d in ("d1", "d2"):
        agg.registry.register(hello(device_id=d, task="bbc"))
    assert agg.engine.start_round()
    first = {a.state.transfer_id for a in _assignments(sent)}
    assert len(first) == 2
    t0 = max(agg.engine.current.sent.values())
    sent.clear()
    assert agg.engine.resend_unacked(t0 + 59) == 0 and not sent
    assert agg.engine.resend_unacked(t0 + 61) == 2
    again = _assignments(sent)
    assert {(a.round, a.attempt) for a in again} == {(1, 0)}  # the same round and attempt ...
    assert not first & {a.state.transfer_id for a in again}  # ... with a new state transfer each
    assert sum(t.endswith("/down/state") for t, _ in sent) >= 2
    agg.engine.on_ack("d1", Ack(device_id="d1", round=1, accepted=True, attempt=0))
    later = max(agg.engine.current.sent.values())
    sent.clear()
    for k in range(1, 5):
        agg.engine.resend_unacked(later + 61 * k)
    devices = [t.split("/")[4] for t, _ in sent if t.endswith("/down/assignment")]
    assert devices == ["d2", "d2"]  # d1 acknowledged; d2 reaches the cap of 3 re-sends a round
    assert agg.engine.current.resends == {"d1": 1, "d2": 3}


def test_device_takes_the_state_of_a_resent_assignment():
    """The first assignment's state never arrived; a re-sent copy (same round and attempt)
    names another state transfer, which did: the device trains on that one, and the stray
    states are dropped."""
    from edge_sdk.client import EdgeClient, _Inbox

    a = assignment()
    again = a.model_copy(update={"state": a.state.model_copy(update={"transfer_id": "s2"})})
    inbox = _Inbox(controls=[again], states={"s2": b"state-2", "other": b"x"})
    waits = []

    def wait(done, deadline, what):
        waits.append(what)
        assert done()

    device = SimpleNamespace(_inbox=inbox, _wait=wait)
    assert EdgeClient._await_state(device, a) == b"state-2"
    assert waits == ["adapter state"] and inbox.states == {"other": b"x"}


@pytest.mark.slow
def test_an_assignment_missed_by_a_device_is_resent_over_mosquitto(mosquitto_url, tmp_path):
    """A device that was online but not subscribed when round 1 was assigned (as a QoS 0
    downlink loses a message while a device moves between cluster nodes) gets the same
    assignment again within ``assignment_resend_s``; the round completes with the other
    device's update."""
    import time

    from protocol.messages import Hello, Status, encode
    from protocol.topics import Topics
    from protocol.transport import Transport
    from tests.federation import Federation, drain_downlink

    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2,), min_devices=2, round_timeout_s=60,
                     config_kw={"assignment_resend_s": 2.0})
    t = Topics(fed.federation)
    late = Transport(mosquitto_url, "late-device").connect()
    late.publish(t.up("late", "status"), encode(Status(device_id="late", state="online")), retain=True)
    late.publish(t.up("late", "hello"), encode(Hello(device_id="late", sdk_version="x", budget_bytes=2**40,
                                                     weight_formats=["int8"], num_samples=40, task="bbc",
                                                     runtime_bytes=0)), retain=True)
    got, replies, subscribed = [], [], []

    def extra(f):
        end = time.time() + 60
        while f.aggregator.engine.current is None and time.time() < end:
            time.sleep(0.05)
        assert f.aggregator.engine.current is not None and "late" in f.aggregator.engine.current.selected
        late.subscribe(t.device_down("late"), qos=0, timeout=10)  # after round 1 was assigned: its first copy is lost
        subscribed.append(time.time())
        drain_downlink(late, 20, replies, got, until=lambda: bool(got))
        a = got[0]
        late.publish(t.up("late", "ack"), encode(Ack(device_id="late", round=a.round, accepted=False,
                                                     attempt=a.attempt, reason="round failed on device: test")))

    try:
        (rec,) = fed.run(extra=extra)
    finally:
        late.close()
    assert got and (got[0].round, got[0].attempt) == (1, 0), got  # the round's assignment, sent again
    assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0"} and "late" in rec["failures"], rec
