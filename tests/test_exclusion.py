"""Nobody is left out in silence: exclusion notices, failed rounds told to devices."""

import pytest

from tests.federation import Federation


@pytest.mark.slow
def test_device_too_small_for_one_expert_is_told_why_and_recorded(mosquitto_url, tmp_path):
    """dev1's budget holds no expert per layer: every round's record names it under
    ``excluded`` with the figures, the device receives an ``excluded`` command with its
    budget and the plan it would need, and the rounds go on with dev0."""
    fed = Federation(mosquitto_url, str(tmp_path), rounds=2, experts=(2, 0))
    records = fed.run()
    assert [r["status"] for r in records] == ["ok", "ok"]
    for r in records:
        assert list(r["devices"]) == ["dev0"]
        assert "dev1" in r["excluded"]
        assert "below the" in r["excluded"]["dev1"] and "one expert per layer" in r["excluded"]["dev1"]
    notices = [n for n in fed.clients[1].notices if n.kind == "excluded"]
    assert {n.round for n in notices} == {1, 2}  # told in each round it could not take part in
    n = notices[0]
    assert n.budget_bytes == fed.clients[1].budget_bytes and n.needed_bytes > n.budget_bytes
    assert fed.clients[1].history == []
    assert not [n for n in fed.clients[0].notices if n.kind == "excluded"]


@pytest.mark.slow
def test_failed_aggregation_is_told_to_devices_and_the_service_goes_on(mosquitto_url, tmp_path):
    """Aggregation raises in round 1: the round is recorded as ``failed`` with the error,
    the global model is unchanged, every selected device gets ``round_failed``, and
    round 2 completes normally."""
    fed = Federation(mosquitto_url, str(tmp_path), rounds=2, experts=(2, 2))
    engine = fed.aggregator.engine
    real, calls = engine.strategy.aggregation.aggregate, []
    before = {k: v.clone() for k, v in engine.model.state.items()}

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom in aggregation")
        return real(*a, **k)

    engine.strategy.aggregation.aggregate = flaky
    real_close, after = engine.close_round, []

    def close():
        rec = real_close()
        after.append({k: v.clone() for k, v in engine.model.state.items()})
        return rec

    engine.close_round = close
    records = fed.run()
    assert [r["status"] for r in records] == ["failed", "ok"]
    assert "boom in aggregation" in records[0]["error"]
    assert records[0]["accuracy"] is None
    for c in fed.clients:
        failed = [n for n in c.notices if n.kind == "round_failed"]
        assert [n.round for n in failed] == [1] and "unchanged" in failed[0].reason
        assert [h.round for h in c.history] == [1, 2]
    assert all((after[0][k] == before[k]).all() for k in before)  # round 1 left the global model as it was
    assert any(not (after[1][k] == before[k]).all() for k in before)  # round 2 moved it


@pytest.mark.slow
def test_non_finite_aggregate_is_not_committed(mosquitto_url, tmp_path):
    """Pre-commit guard: an aggregation that yields NaN (e.g. an overflow) fails the round
    with the reason, keeps the previous global state (step norm 0), tells the devices,
    and the next round commits normally; every record carries the state and step norms."""
    fed = Federation(mosquitto_url, str(tmp_path), rounds=2, experts=(2, 2))
    engine = fed.aggregator.engine
    real, calls = engine.strategy.aggregation.aggregate, []

    def overflow(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        if len(calls) == 1:
            key = next(iter(out))
            out = {**out, key: out[key] * float("nan")}
        return out

    engine.strategy.aggregation.aggregate = overflow
    records = fed.run()
    assert [r["status"] for r in records] == ["failed", "ok"]
    assert "not finite" in records[0]["error"]
    assert records[0]["global_step_norm"] == 0.0 and records[1]["global_step_norm"] > 0
    assert all(r["global_state_norm"] > 0 for r in records)
    for c in fed.clients:
        assert [n.round for n in c.notices if n.kind == "round_failed"] == [1]


def test_a_round_waits_for_a_device_that_just_went_offline_and_names_the_absent(caplog):
    """``reconnect_grace_s``: a registered device offline for less than the grace holds the
    next round's start (a broker failover moves every client), once it has been offline
    longer the round starts without it; the wait is logged once per set of devices, and a
    round record names who was offline (``offline``)."""
    import logging
    import time
    from types import SimpleNamespace

    from cloud.registry import Device, Registry
    from cloud.rounds.state import OpenRound
    from cloud.service import Aggregator

    reg = Registry.__new__(Registry)
    reg.devices = {d: Device(d, "bbc", 2**30, 10, ["int8"]) for d in ("dev0", "dev1")}
    agg = SimpleNamespace(cfg=SimpleNamespace(reconnect_grace_s=15.0), registry=reg,
                          engine=SimpleNamespace(completed=1), _awaited=[])
    assert not Aggregator._awaiting_reconnect(agg)
    reg.devices["dev1"].online, reg.devices["dev1"].last_seen = False, time.time() - 5
    with caplog.at_level(logging.INFO, logger="cloud.service"):
        assert Aggregator._awaiting_reconnect(agg) and Aggregator._awaiting_reconnect(agg)
    assert [r.getMessage() for r in caplog.records if "waits up to" in r.getMessage()] == \
        ["round 2 waits up to 15 s for 1 device(s) that went offline to reconnect: dev1"]
    reg.devices["dev1"].last_seen = time.time() - 16
    assert not Aggregator._awaiting_reconnect(agg)
    assert [d.device_id for d in reg.offline()] == ["dev1"]
    rnd = OpenRound(2, 0.0, 1.0, {}, {}, 0.0, offline=["dev1"])
    from cloud.rounds.recovery import Recovery
    assert Recovery.round_from_json({"number": 2, "started": 0.0, "deadline": 1.0, "selected": {},
                                     "offline": rnd.offline}).offline == ["dev1"]
