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
