"""Defences against poisoned updates: screening, the pre-commit guard, and a failing
close that fails only its round (cloud/robust, cloud/rounds/)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from cloud.aggregation.modular import Modular
from cloud.robust.config import DefenceConfig, GuardConfig, ScreeningConfig
from cloud.robust.guard import StepGuard, l2_norm
from cloud.robust.screening import UpdateScreen, group_of
from cloud.strategy import ClientResult
from protocol.messages import BlobRef, LayerStats, Stats

GLOBAL = {
    "backbone.q.lora_B": torch.zeros(4, 4),
    "expert.0.0.fc1.lora_B": torch.zeros(3, 2),
    "expert.0.1.fc1.lora_B": torch.zeros(3, 2),
    "router.0.0": torch.zeros(4),
    "router.0.1": torch.zeros(4),
    "head.bbc.weight": torch.zeros(2, 4),
}


def _result(device: str, scale: float, experts=(0,), samples: int = 10, usage=None) -> ClientResult:
    """A result whose change is ``scale`` in every coordinate of what it holds."""
    state = {k: torch.full_like(v, scale) for k, v in GLOBAL.items()
             if not k.startswith(("expert.", "router.")) or int(k.split(".")[2]) in experts}
    stats = None
    if usage is not None:
        layer = LayerStats(layer=0, tokens=1000, usage=usage, expert_samples=[0, 0], activation_prob=[0.5] * 2,
                           routing_dist=[0.5] * 2, margin=[0.1] * 2, expert_loss=[0.7] * 2, expert_acc=[0.5] * 2)
        stats = Stats(device_id=device, round=1, task="bbc", num_samples=samples, train_loss=0.0, layers=[layer],
                      update=BlobRef(transfer_id="x", bytes=1, sha256="0" * 64, chunks=1), train_seconds=1.0,
                      bytes_up=1, bytes_down=1, peak_rss_bytes=1, baseline_rss_bytes=0, shards_fetched=[])
    return ClientResult(device, "bbc", samples, {0: list(experts)}, state, stats)


def test_group_and_kind_names():
    assert group_of("expert.1.3.fc1.lora_B") == ("expert.1", "expert.1.3")
    assert group_of("router.1.3") == ("router.1", "router.1")
    assert group_of("head.bbc.weight") == ("head.bbc", "head.bbc")
    assert group_of("backbone.x") == ("backbone", "backbone")


def test_scaled_update_is_clipped_to_the_bound_and_a_huge_one_rejected():
    screen = UpdateScreen(ScreeningConfig(clip_factor=2.0, reject_factor=20.0))
    results = [_result(f"h{i}", 1.0) for i in range(4)] + [_result("x5", 5.0), _result("x100", 100.0)]
    out = screen.screen(1, GLOBAL, results)
    assert set(out.rejected) == {"x100"} and "backbone" in out.rejected["x100"] or "expert" in out.rejected["x100"]
    assert "x100" not in {r.device_id for r in out.results}
    clipped = next(r for r in out.results if r.device_id == "x5")
    # every group of x5 is clipped to exactly 2 x the reference (the honest change: 1.0 per coordinate)
    for k, v in clipped.state.items():
        assert torch.allclose(v, torch.full_like(v, 2.0)), k
    honest = next(r for r in out.results if r.device_id == "h0")
    assert all(torch.equal(v, torch.ones_like(v)) for v in honest.state.values())
    assert out.report["clipped"]["x5"]["groups"] == 4 and out.report["clipped"]["x5"]["max_ratio"] == 5.0
    assert screen.references["backbone"] == pytest.approx(4.0)  # ||ones(4,4)||


def test_reference_counts_only_the_experts_a_device_routed_tokens_to():
    """Routing concentrated on expert 0: expert 1 got no token on any device and barely
    changed (0.01, an encoding residual). Counting it would halve the layer's reference
    and put every honest trained expert over the clip bound; counted over routed experts
    only, honest changes pass untouched and a 30x one is still rejected."""
    def honest(name):
        r = _result(name, 1.0, experts=(0, 1), usage=[40, 0])
        r.state["expert.0.1.fc1.lora_B"] = torch.full((3, 2), 0.01)
        return r

    screen = UpdateScreen(ScreeningConfig(clip_factor=1.5, reject_factor=20.0))
    out = screen.screen(1, GLOBAL, [honest(f"h{i}") for i in range(4)])
    assert screen.references["expert.0"] == pytest.approx(math.sqrt(6))   # ||ones(3, 2)||, expert 0 only
    assert not out.report["clipped"] and not out.rejected
    h = next(r for r in out.results if r.device_id == "h0")
    assert torch.equal(h.state["expert.0.0.fc1.lora_B"], torch.ones(3, 2))
    attacker = _result("x", 30.0, experts=(0, 1), usage=[40, 0])
    assert set(screen.screen(2, GLOBAL, [honest(f"h{i}") for i in range(4)] + [attacker]).rejected) == {"x"}
    # the same round judged over every held expert (no statistics): the reference falls halfway to
    # the unrouted experts' residuals and every honest device's trained expert is clipped
    blind = UpdateScreen(ScreeningConfig(clip_factor=1.5, reject_factor=20.0))
    results = [honest(f"h{i}") for i in range(4)]
    for r in results:
        r.stats = None
    assert set(blind.screen(1, GLOBAL, results).report["clipped"]) == {"h0", "h1", "h2", "h3"}


def test_plain_fedavg_without_screening_is_ruined_by_the_same_update():
    """The test above can fail: without screening the x100 device moves the mean 20x."""
    results = [_result(f"h{i}", 1.0) for i in range(4)] + [_result("x100", 100.0)]
    out = Modular().aggregate(1, GLOBAL, results, [])
    assert out["backbone.q.lora_B"][0, 0] == pytest.approx(104 / 5)


def test_lone_expert_measured_against_its_layer_and_damped_by_min_holders():
    screen = UpdateScreen(ScreeningConfig(), min_holders=2)
    results = [_result(f"h{i}", 1.0, experts=(0,)) for i in range(3)] + [_result("lone", 1.5, experts=(1,))]
    out = screen.screen(1, GLOBAL, results)
    lone = next(r for r in out.results if r.device_id == "lone")
    assert torch.allclose(lone.state["expert.0.1.fc1.lora_B"], torch.full((3, 2), 0.75))  # 1.5 x 1/2 holders
    assert torch.allclose(lone.state["router.0.1"], torch.full((4,), 0.75))               # its router row too
    assert torch.allclose(lone.state["backbone.q.lora_B"], torch.full((4, 4), 1.5))       # not an expert
    assert out.report["damped"] == {"expert.0.1": 1}
    h = next(r for r in out.results if r.device_id == "h0")
    assert torch.allclose(h.state["expert.0.0.fc1.lora_B"], torch.ones(3, 2))             # 3 holders: not damped


def test_sample_claims_capped_with_their_usage():
    screen = UpdateScreen(ScreeningConfig(sample_cap_factor=3.0))
    results = [_result(f"h{i}", 1.0, samples=10, usage=[5, 0]) for i in range(3)]
    results.append(_result("liar", 1.0, samples=10**6, usage=[1000, 0]))
    out = screen.screen(1, GLOBAL, results)
    liar = next(r for r in out.results if r.device_id == "liar")
    assert liar.num_samples == 30 and liar.stats.num_samples == 30 and liar.stats.layers[0].usage == [0, 0]
    assert out.report["capped_samples"] == {"liar": [10**6, 30]}
    agg = Modular().aggregate(1, GLOBAL, out.results, [])
    assert agg["backbone.q.lora_B"][0, 0] == pytest.approx(1.0)


def test_a_worker_caps_a_claim_alone_by_the_rounds_declared_samples():
    """A worker screens one update at a time, so the cap comes from the selected devices'
    declared samples (set when the round started), not from the claims it has not seen."""
    from cloud.robust.defences import Defences

    d = Defences(DefenceConfig(screening=ScreeningConfig(sample_cap_factor=3.0), robust={"name": "none"}))
    cap = d.round_sample_cap([10, 10, 10, 10**6])  # the liar's hello cannot move the median
    assert cap == 30 and d.round_sample_cap([]) is None
    alone = d.screen_update(1, GLOBAL, _result("liar", 1.0, samples=10**6, usage=[1000, 0]), cap)
    (liar,) = alone.results
    assert liar.num_samples == 30 and liar.stats.layers[0].usage == [0, 0]
    assert alone.report["capped_samples"] == {"liar": [10**6, 30]}
    honest = d.screen_update(1, GLOBAL, _result("h", 1.0, samples=10, usage=[5, 0]), cap)
    assert honest.results[0].num_samples == 10 and not honest.report["capped_samples"]
    assert Defences(DefenceConfig(screening=None, robust={"name": "none"})).round_sample_cap([10]) is None


def test_reference_from_last_round_when_too_few_norms():
    screen = UpdateScreen(ScreeningConfig(min_reference=3))
    screen.screen(1, GLOBAL, [_result(f"h{i}", 1.0) for i in range(3)])
    out = screen.screen(2, GLOBAL, [_result("alone", 50.0)])     # one device: last round's reference applies
    assert set(out.rejected) == {"alone"}
    fresh = UpdateScreen(ScreeningConfig(min_reference=3)).screen(1, GLOBAL, [_result("alone", 50.0)])
    assert not fresh.rejected and not fresh.report["clipped"]   # no reference yet: not screened (the guard bounds it)
    restored = UpdateScreen(ScreeningConfig())
    restored.load_state_dict(screen.state_dict())
    assert restored.references == screen.references


def test_non_finite_change_rejected():
    bad = _result("nan", 1.0)
    bad.state["backbone.q.lora_B"] = torch.full((4, 4), float("inf"))
    out = UpdateScreen(ScreeningConfig()).screen(1, GLOBAL, [_result(f"h{i}", 1.0) for i in range(3)] + [bad])
    assert set(out.rejected) == {"nan"}


def test_guard_bounds():
    prev = {"a": torch.ones(4)}
    g = StepGuard(GuardConfig(max_step_factor=10.0, max_relative_step=1.0, warmup_rounds=2))
    assert "not finite" in g.problem(prev, {"a": torch.tensor([1.0, float("nan"), 1, 1])})
    assert "previous state" in g.problem(prev, {"a": torch.full((4,), 3.5)})   # step 5 > 1 x ||prev|| = 2
    assert g.problem(prev, {"a": torch.full((4,), 1.5)}) is None
    g.committed(0.1)
    g.committed(0.1)
    assert "median" in g.problem(prev, {"a": torch.full((4,), 1.6)})          # step 1.2 > 10 x 0.1
    assert g.problem(prev, {"a": torch.full((4,), 1.4)}) is None              # step 0.8
    assert StepGuard(None).problem(prev, {"a": torch.full((4,), 100.0)}) is None
    assert l2_norm([torch.ones(4)]) == 2.0


def test_config_validation():
    with pytest.raises(ValidationError, match="reject_factor"):
        ScreeningConfig(clip_factor=5, reject_factor=2)
    with pytest.raises(ValidationError, match="robust rule"):
        DefenceConfig(dp={"noise_multiplier": 1.0, "clip_norm": 1.0}, robust={"name": "median"})
    with pytest.raises(ValidationError, match="needs screening"):
        DefenceConfig(screening=None, min_holders=2)
    with pytest.raises(ValidationError):
        DefenceConfig(robust={"name": "krum"})
    assert DefenceConfig().screening is not None and DefenceConfig().guard is not None
    assert DefenceConfig().robust.name == "multi_krum"                      # the default rule
    assert DefenceConfig(dp={"noise_multiplier": 1.0, "clip_norm": 1.0}).robust.name == "none"  # DP replaces it


# ---------------------------------------------------------------- the engine, offline
def _offline(tmp_path, monkeypatch, **kw):
    from tests.test_bounds import _offline as make

    return make(str(tmp_path), monkeypatch, **kw)


def _one_round(agg, devices=("a", "b")):
    from tests.test_bounds import _hello, _send, _stats, _upload

    for d in devices:
        _hello(agg, d, 10)
    assert agg.engine.start_round()
    for d in devices:
        _send(agg, d, _stats(agg, d, _upload(agg, d, 0.01), 10))
    assert all(agg.engine.current.reported(d) for d in devices)


def test_exception_outside_aggregation_fails_only_that_round_and_is_quarantined(tmp_path, monkeypatch):
    """A failure the aggregation's own guard does not cover (here the registry, while
    committing) fails the round: record stored, previous state kept, devices told, the
    accepted messages quarantined; a restart resumes nothing and the next round runs."""
    from cloud.service import Aggregator

    agg, replies = _offline(tmp_path, monkeypatch, defences={"guard": None})  # the failure must come from commit
    before = {k: v.clone() for k, v in agg.model.state.items()}
    _one_round(agg)
    monkeypatch.setattr(agg.registry, "accepted", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    sent = len(agg.engine.wire.sent)
    rec = agg.engine.close_round()
    assert rec["status"] == "failed" and "RuntimeError: boom" in rec["error"]
    assert all(torch.equal(agg.model.state[k], v) for k, v in before.items())
    assert sum(t.endswith("/command") for t in agg.engine.wire.sent[sent:]) == 2  # round_failed to both
    assert agg.store.blob_keys("quarantine/1/update/") == ["quarantine/1/update/a", "quarantine/1/update/b"]
    assert agg.store.blob_keys("inflight/") == [] and agg.store.get_json("current_round") is None
    agg.store.close()
    agg2 = Aggregator(agg.cfg, "mqtt://127.0.0.1:1")
    assert agg2.engine.current is None and agg2.engine.completed == 1
    assert [r["status"] for r in agg2.store.rounds()] == ["failed"]
    agg2.store.close()


def test_guard_refuses_a_wild_aggregate(tmp_path, monkeypatch):
    agg, replies = _offline(tmp_path, monkeypatch)
    before = {k: v.clone() for k, v in agg.model.state.items()}
    _one_round(agg)
    monkeypatch.setattr(agg.engine.strategy.aggregation, "aggregate",
                        lambda r, g, res, f: {k: v + 1e3 for k, v in g.items()})
    sent = len(agg.engine.wire.sent)
    rec = agg.engine.close_round()
    assert rec["status"] == "failed" and rec["error"].startswith("guard: the global step has L2 norm")
    assert rec["global_step_norm"] == 0.0
    assert all(torch.equal(agg.model.state[k], v) for k, v in before.items())
    assert sum(t.endswith("/command") for t in agg.engine.wire.sent[sent:]) == 2  # round_failed to both
    assert agg.store.blob_keys("quarantine/1/update/")
    agg.store.close()


def test_screening_report_in_the_round_record(tmp_path, monkeypatch):
    agg, _ = _offline(tmp_path, monkeypatch, defences={"guard": None})  # constant test updates are a wild step
    _one_round(agg, devices=("a", "b", "c"))
    rec = agg.engine.close_round()
    assert rec["status"] == "ok" and set(rec["screening"]) == {"reference", "clipped", "rejected", "capped_samples",
                                                               "damped"}
    assert rec["screening"]["rejected"] == {} and "backbone" in rec["screening"]["reference"]
    assert math.isfinite(rec["global_step_norm"]) and rec["global_step_norm"] > 0
    agg.store.close()


# ---------------------------------------------------------------- over a real broker
def _scaled(client, factor: float) -> None:
    """Make ``client`` send ``sent + factor x (trained - sent)`` (signed and schema-valid)."""
    from edge_sdk.filters import TransformUpdate

    def update(trained, ctx):
        return {k: ctx.sent[k] + factor * (trained[k] - ctx.sent[k]) for k in ctx.sent}
    client.filters.insert(0, TransformUpdate(update))


@pytest.mark.slow
def test_lying_devices_over_mosquitto_are_capped_clipped_and_rejected(mosquitto_url, tmp_path):
    """Five devices, three of them lying: one claims 10^5 samples (its hello too), one
    sends 8x its update, one 1000x. The round closes with the claim capped, the 8x update
    clipped, the 1000x one rejected with a reply, and the global step of honest size."""
    from edge_sdk.filters import ClaimSamples
    from tests.federation import Federation

    def hook(c):
        if c.device_id == "dev2":
            c.filters.insert(0, ClaimSamples(lambda n: 10**5))
        elif c.device_id == "dev3":
            _scaled(c, 8.0)
        elif c.device_id == "dev4":
            _scaled(c, 1000.0)

    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2, 2, 2, 2, 2), client_hook=hook,
                     round_timeout_s=90)
    (rec,) = fed.run(timeout=240)
    s = rec["screening"]
    assert rec["status"] == "ok", rec.get("error")
    assert s["capped_samples"]["dev2"][0] == 10**5 and s["capped_samples"]["dev2"][1] <= 3 * 40
    assert rec["devices"]["dev2"]["samples"] == s["capped_samples"]["dev2"][1]  # the weight it got
    assert "dev3" in s["clipped"] and s["clipped"]["dev3"]["max_ratio"] > 2
    assert set(s["rejected"]) == {"dev4"} and "update rejected by screening" in rec["failures"]["dev4"]
    dev4 = next(c for c in fed.clients if c.device_id == "dev4")
    assert any(n.kind == "reject" and n.reason.startswith("update rejected: the change of") for n in dev4.notices)
    assert set(rec["devices"]) == {"dev0", "dev1", "dev2", "dev3"}
    assert rec["global_step_norm"] < 10 * s["reference"]["backbone"] + sum(s["reference"].values())


@pytest.mark.slow
def test_failures_while_closing_fail_only_their_round_over_mosquitto(mosquitto_url, tmp_path):
    """Round 1's aggregation raises, round 2's aggregate is wild (the guard refuses it),
    round 3 commits. Devices are told, nothing is replayed after a restart."""
    from cloud.service import Aggregator
    from tests.federation import Federation

    fed = Federation(mosquitto_url, str(tmp_path), rounds=3, experts=(2, 2), round_timeout_s=60)
    engine = fed.aggregator.engine
    inner = engine.strategy.aggregation.aggregate

    def aggregate(rnd, state, results, failures):
        if rnd == 1:
            raise ValueError("a message this strategy cannot handle")
        new = inner(rnd, state, results, failures)
        return {k: v * 1e4 for k, v in new.items()} if rnd == 2 else new

    engine.strategy.aggregation.aggregate = aggregate
    records = fed.run(timeout=240)
    assert [r["status"] for r in records] == ["failed", "failed", "ok"]
    assert "ValueError: a message this strategy cannot handle" in records[0]["error"]
    assert records[1]["error"].startswith("guard: the global step has L2 norm")
    assert records[0]["global_step_norm"] == records[1]["global_step_norm"] == 0.0 < records[2]["global_step_norm"]
    for c in fed.clients:
        assert {n.round for n in c.notices if n.kind == "round_failed"} == {1, 2}
    store = fed.aggregator.store
    agg2 = Aggregator(fed.aggregator.cfg, "mqtt://127.0.0.1:1")
    assert agg2.engine.current is None and agg2.engine.completed == 3
    assert agg2.store.blob_keys("quarantine/1/update/") and agg2.store.blob_keys("quarantine/2/update/")
    assert not agg2.store.blob_keys("inflight/") and not agg2.store.blob_keys("quarantine/3/")
    agg2.store.close()
    del store


def test_dp_fedavg_reports_epsilon_in_the_round_record(tmp_path, monkeypatch):
    agg, _ = _offline(tmp_path, monkeypatch,
                      defences={"guard": None, "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "seed": 3}})
    _one_round(agg)
    rec = agg.engine.close_round()
    rep = rec["aggregation_report"]
    assert rec["status"] == "ok" and rep["rounds"] == 1 and rep["noise_multiplier"] == 1.0
    assert rep["epsilon"] == pytest.approx(4.7285, abs=1e-3)   # T=1, sigma=1, delta=1e-5 (tests/test_dp.py)
    assert agg.store.get_json("strategy_state")["aggregation"]["steps"] == [[1.0, 1.0]]
    agg.store.close()


@pytest.mark.parametrize("attempts", [1, 2])
def test_a_round_whose_closing_killed_the_aggregator_twice_is_failed_on_restart(tmp_path, monkeypatch, attempts):
    """Closing is marked in the store before it starts. A restart after one interrupted
    close closes the round again; after two (something in the round kills the process:
    a message exhausting memory, a native crash) it fails the round and quarantines its
    messages instead of dying a third time."""
    from cloud.service import Aggregator

    agg, _ = _offline(tmp_path, monkeypatch)
    _one_round(agg)
    agg.store.put_json("closing_round", {"round": 1, "attempts": attempts})  # as a killed close leaves it
    agg.store.close()
    agg2 = Aggregator(agg.cfg, "mqtt://127.0.0.1:1")
    if attempts == 1:
        assert agg2.engine.current is not None and agg2.engine.current.number == 1
        assert set(agg2.engine.current.updates) == {"a", "b"}
    else:
        assert agg2.engine.current is None and agg2.engine.completed == 1
        (rec,) = agg2.store.rounds()
        assert rec["status"] == "failed" and "stopped 2 times while closing" in rec["error"]
        assert agg2.store.blob_keys("quarantine/1/update/") and not agg2.store.blob_keys("inflight/")
        assert agg2.store.get_json("closing_round") is None
    agg2.store.close()


def test_a_round_past_its_warm_up_streams_into_sums_and_closes_as_a_held_round_does(tmp_path, monkeypatch):
    """One process, a method that aggregates by sums (no robust rule): after the warm-up
    (the first STREAM_WARMUP reporters, screened together) each reported update is screened
    alone and folded in, its tensors dropped; a wild update is still rejected. At every
    batch's end each accepted update is in the store as its payload or in the stored sums,
    never both or neither; a batch whose payloads would weigh at least the sums stores the
    sums instead. The new global state equals the held round's, also across restarts."""
    import cloud.rounds.streaming as streaming
    from cloud.service import Aggregator
    from tests.test_bounds import _hello, _send, _stats, _upload
    from tests.test_fuzz import _Wire

    monkeypatch.setattr(streaming, "STREAM_WARMUP", 3)  # screening's min_reference
    devices = [f"d{i}" for i in range(6)]
    values = {d: 0.02 + 0.001 * i for i, d in enumerate(devices)}
    values["d5"] = 50.0  # after the warm-up
    batches = [devices[:3], devices[3:4], devices[4:]]  # 3 folded (settles), 1 (stored whole), 2 (settles)

    def one_round(folder, stream: bool, restart_after: int | None = None):
        folder.mkdir()
        agg, _ = _offline(folder, monkeypatch, defences={"guard": None, "robust": {"name": "none"}})
        if not stream:
            agg.engine.streams = lambda: False
        for d in devices:
            _hello(agg, d, 10)
        assert agg.engine.start_round()
        n = agg.engine.current.number
        for b, batch in enumerate(batches):
            for d in batch:
                _send(agg, d, _stats(agg, d, _upload(agg, d, values[d]), 10))
            agg.engine.end_batch()  # the end of the batch the messages came in (Aggregator._pump)
            if stream:
                sent = [d for x in batches[:b + 1] for d in x]
                payloads = {k.rsplit("/", 1)[1] for k in agg.store.blob_keys(f"inflight/{n}/update/")}
                folded = {k.rsplit("/", 1)[1] for k in agg.store.json_keys(f"inflight/{n}/folded/")}
                assert payloads | folded == set(sent) and not payloads & folded, (b, payloads, folded)
                assert payloads == ({"d3"} if b == 1 else set())
            if b == restart_after:
                agg.store.close()
                agg = Aggregator(agg.cfg, "mqtt://127.0.0.1:1")
                agg.engine.wire = _Wire()
        return agg, agg.engine.current

    held_agg, held = one_round(tmp_path / "held", stream=False)
    assert held.stream is None and all(held.updates[d][1] for d in devices)
    held_rec = held_agg.engine.close_round()
    for restart_after in (None, 0, 1):
        agg, rnd = one_round(tmp_path / f"stream{restart_after}", stream=True, restart_after=restart_after)
        assert rnd.stream is not None and rnd.stream.warmup is None and rnd.stream.sums.devices == 5
        assert all(rnd.updates[d][1] == {} for d in devices)                  # nothing held
        assert rnd.stream.markers["d5"]["status"] == "rejected"
        rec = agg.engine.close_round()
        assert rec["status"] == held_rec["status"] == "ok"
        assert set(rec["screening"]["rejected"]) == set(held_rec["screening"]["rejected"]) == {"d5"}
        assert rec["screening"]["streaming"] is True
        for k, v in held_agg.model.state.items():
            assert torch.allclose(agg.model.state[k], v, atol=1e-6), (restart_after, k)
        agg.store.close()
    held_agg.store.close()
