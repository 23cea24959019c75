"""The strategy API: a method in one module (tests/toy_strategy.py) runs end to end, the
engine validates what a strategy plans, and no layer imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cloud.service import StrategyConfig
from cloud.strategies import Composed, get_strategy
from protocol.codec import decode_tensors
from cloud.strategy import Setup
from protocol.messages import MessageError, Objective, Stats, TrainConfig, encode, parse_message
from tests import toy_strategy  # noqa: F401  (registers the toy strategy and its objective term)
from tests.federation import Federation
from tests.test_bounds import _hello, _offline, _send, _stats, _upload

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_toy_strategy_runs_in_a_federation_on_the_embedded_broker(tmp_path, embedded_url):
    fed = Federation(embedded_url, str(tmp_path), rounds=3, experts=(2, 4),
                     config_kw={"strategy": StrategyConfig(name="toy", params={"weight": 0.5})})
    records = fed.run()
    assert [r["status"] for r in records] == ["ok"] * 3 and all(r["strategy"] == "toy" for r in records)
    for n, r in enumerate(records):
        m = r["strategy_metrics"]
        assert set(m["penalties"]) == {"dev0", "dev1"} and all(p > 0 for p in m["penalties"].values())
        # each device ran the objective with the cloud's parameter and the extra tensor it was sent
        assert m["offset_sent"] == n
        assert all(e == [0.5, float(n)] for e in m["echoes"].values()), m["echoes"]
    owned = fed.aggregator.model.owned
    assert int(owned["toy.rounds"]) == 3
    last = records[-1]["strategy_metrics"]["penalties"]
    assert float(owned["toy.penalty"]) == pytest.approx(sum(last.values()) / 2, rel=1e-6)
    assert all(len(c.history) == 3 and not c.notices for c in fed.clients)


def test_owned_tensors_and_strategy_state_survive_a_restart(tmp_path, monkeypatch):
    agg, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "toy", "params": {"weight": 0.2}})
    for d in ("a", "b"):
        _hello(agg, d)
    assert agg.engine.start_round()
    rnd = agg.engine.current
    for d in ("a", "b"):
        assert float(rnd.tensors[d]["toy.offset"]) == 0.0
        _send(agg, d, _stats(agg, d, _upload(agg, d, 0.01), 10,
                             extras={"toy_l2.penalty": [0.25], "toy_l2.echo": [0.2, 0.0]}))
    record = agg.engine.close_round()
    assert record["status"] == "ok" and record["strategy_metrics"]["penalties"] == {"a": 0.25, "b": 0.25}
    stored = decode_tensors(agg.store.get_blob("strategy_tensors"), 2**20)
    assert int(stored["toy.rounds"]) == 1 and float(stored["toy.penalty"]) == 0.25
    assert agg.engine.start_round()            # round 2 in flight, then the aggregator "dies"
    url = agg.cfg.store
    agg.store.close()
    again, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "toy", "params": {"weight": 0.2}})
    assert again.cfg.store == url and int(again.model.owned["toy.rounds"]) == 1
    assert again.engine.strategy.sent == {1: 0.0, 2: 1.0}
    # the resumed round re-sends exactly what it planned: the same objective and extra tensor
    cur = again.engine.current
    assert cur.number == 2 and all(float(cur.tensors[d]["toy.offset"]) == 1.0 for d in ("a", "b"))
    assert all(cur.objectives[d] == [Objective(name="toy_l2", params={"weight": 0.2})] for d in ("a", "b"))
    again.store.close()


def test_stats_without_what_the_strategy_asked_for_are_refused(tmp_path, monkeypatch):
    agg, replies = _offline(str(tmp_path), monkeypatch, strategy={"name": "toy"})
    _hello(agg, "a")
    assert agg.engine.start_round()
    _send(agg, "a", _stats(agg, "a", _upload(agg, "a"), 10))
    assert "a" not in agg.engine.current.stats
    assert any("toy: extras lack" in (c.reason or "") for d, c in replies if d == "a")
    agg.store.close()


def test_objectives_only_go_to_devices_that_understand_them(tmp_path, monkeypatch):
    agg, replies = _offline(str(tmp_path), monkeypatch, strategy={"name": "toy"})
    _hello(agg, "new")
    _hello(agg, "old", minor=1)                 # a 1.1 SDK would drop the objective and train without it
    assert agg.engine.start_round()
    assert set(agg.engine.current.selected) == {"new"}
    why = agg.engine.excluded["old"]
    assert "protocol minor 1" in why and "minor 2" in why
    assert "fl/v1/bd/dev/old/down/command" in agg.engine.wire.sent        # the device was told
    agg.store.close()


class _Broken(Composed):
    """Plans that the engine must refuse device by device, or a configure that raises."""

    name = "broken_for_test"
    mode = "layers"

    def configure_round(self, round, devices, model):
        if self.mode == "raise":
            raise RuntimeError("solver exploded")
        plan = super().configure_round(round, devices, model)
        first = sorted(plan.assignments)[0]
        if self.mode == "layers":
            plan.assignments[first] = {model.layers[0]: [0, 0]}       # the same expert twice
        elif self.mode == "tensor":
            plan.tensors[first] = {"expert.0.0.x": torch.zeros(2)}     # an adapter-state name
        elif self.mode == "nan":
            plan.tensors[first] = {"toy.x": torch.tensor([float("nan")])}
        elif self.mode == "train":
            plan.train[first] = {"lr": -1.0}
        return plan


@pytest.mark.parametrize("mode,reason", [("layers", "not 1.."), ("tensor", "adapter-state namespace"),
                                         ("nan", "non-finite"), ("train", "invalid training overrides")])
def test_an_invalid_plan_excludes_that_device_and_the_round_goes_on(tmp_path, monkeypatch, mode, reason):
    monkeypatch.setattr(_Broken, "mode", mode)
    agg, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "broken_for_test"})
    _hello(agg, "a")
    _hello(agg, "b")
    assert agg.engine.start_round()                          # no RuntimeError: the aggregator stays up
    assert set(agg.engine.current.selected) == {"b"}
    assert reason in agg.engine.excluded["a"], agg.engine.excluded["a"]
    agg.store.close()


def test_a_strategy_that_raises_leaves_the_round_waiting_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(_Broken, "mode", "raise")
    agg, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "broken_for_test"}, start_timeout_s=0.5)
    _hello(agg, "a")
    assert not agg.engine.start_round() and agg.engine.current is None
    assert "solver exploded" in agg.engine.plan_error
    agg.store.close()


def test_extras_in_stats_are_bounded_by_the_schema():
    from tests.test_protocol_versions import stats_dict

    ok = stats_dict()
    ok["extras"] = {"fedalign.r_c": [0.25, 0.75]}
    assert parse_message(encode_json(ok), Stats).extras == {"fedalign.r_c": [0.25, 0.75]}
    for bad in ({"no_namespace": [1.0]}, {"Upper.x": [1.0]}, {"a.b": [1e300]},
                {f"a.k{i}": [0.0] for i in range(65)}, {"a.b": "1.0"}):
        d = dict(ok, extras=bad)
        with pytest.raises(MessageError, match="extras"):
            parse_message(encode_json(d), Stats)


def encode_json(d) -> bytes:
    import json

    return json.dumps(d).encode()


def test_unknown_objective_is_refused_by_the_device_before_training():
    from edge_sdk.objectives import check_objectives, terms_for

    with pytest.raises(ValueError, match="unknown objective term 'nope'.*fedprox"):
        check_objectives([Objective(name="nope")])
    with pytest.raises(ValueError, match="toy_l2 needs the extra tensor"):
        terms_for(_train(), [Objective(name="toy_l2", params={"weight": 1.0})], {})
    with pytest.raises(ValueError, match="'weight' must be a number"):
        terms_for(_train(), [Objective(name="toy_l2", params={"weight": "x"})], {},
                  {"toy.offset": torch.zeros(1)})
    (prox,) = terms_for(_train(prox_mu=0.5), [], {"k": torch.ones(2)})   # the pre-minor-2 way to ask for FedProx
    assert prox.name == "fedprox" and prox.mu == 0.5


def test_terms_share_the_start_state_instead_of_copying_it():
    """A term holding the round's context must not hold a second adapter-sized copy: on
    the peer benchmark's Qwen3-MoE (424 experts, LoRA A and B) the copy was 28 MiB and put
    FedAlign's devices over budget (the plan counts one reference copy)."""
    from edge_sdk.objectives import terms_for

    state = {"k": torch.ones(1000)}
    (prox,) = terms_for(_train(prox_mu=0.5), [], state)
    assert prox.ctx.start_state["k"].data_ptr() == state["k"].data_ptr()


def _train(**kw):
    from protocol.messages import TrainConfig

    return TrainConfig(**kw)


def test_lookup_names_the_known_strategies():
    assert get_strategy("composed") is Composed and get_strategy("toy") is toy_strategy.ToyStrategy
    with pytest.raises(KeyError, match="unknown strategy 'nope'; known: .*composed.*toy"):
        get_strategy("nope")
    with pytest.raises(KeyError, match=r"unknown strategy 'fusion_hybird' \(did you mean 'fusion_hybrid'"):
        get_strategy("fusion_hybird")


# --------------------------------------------------------------------------- layering

LAYERS = ["protocol", "moe_model", "edge_sdk", "cloud", "fedmoe", "benchmarks"]
"""Lowest first (docs/architecture.md): a package may import only its own layer and those below."""


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_module_imports_a_higher_layer():
    bad = []
    for i, layer in enumerate(LAYERS):
        higher = set(LAYERS[i + 1:])
        for path in sorted((ROOT / layer).rglob("*.py")):
            for name in sorted(_imports(path) & higher):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_the_round_engine_has_no_method_specific_branch():
    source = "".join(p.read_text() for p in sorted((ROOT / "cloud" / "rounds").glob("*.py")))
    for word in ("private", "prox", "flex", "fedmoe", "fedalign", "router.", "usage_weighted", "modular"):
        assert word not in source.lower(), word


@pytest.mark.slow
def test_federated_evaluation_reports_what_the_devices_measured(tmp_path, embedded_url):
    """configure_evaluate: every device (evaluate_fraction 1) evaluates the model it received
    on its validation split before training; the record holds the sample-weighted result."""
    fed = Federation(embedded_url, str(tmp_path), rounds=2, experts=(2, 3),
                     config_kw={"strategy": StrategyConfig(name="composed", params={"evaluate_fraction": 1.0})})
    records = fed.run()
    for r in records:
        fe = r["federated_evaluation"]
        assert fe["devices"] == ["dev0", "dev1"] and not fe["refused"]
        assert fe["samples"] == 16 and 0.0 <= fe["accuracy"] <= 1.0 and fe["loss"] > 0   # 2 x 20% of 40 samples
    off = Federation(embedded_url, str(tmp_path / "off"), rounds=1, experts=(2,))
    assert "federated_evaluation" not in off.run()[0]


def test_federated_evaluation_bounds_what_a_device_claims():
    from cloud.strategies.base import Strategy

    s = get_strategy("composed")(Setup([1], 4, 0, TrainConfig(), {"t": ["a", "b"]}, ("random_kept", {}),
                                       ("modular", {})), evaluate_fraction=0.5)
    out = s.evaluate_federated(3, {"a": {"accuracy": 0.5, "loss": 1.0, "samples": 10},
                                   "b": {"accuracy": 1.0, "loss": 0.0, "samples": 30},
                                   "liar": {"accuracy": 7.0, "loss": 1.0, "samples": 10},
                                   "huge": {"accuracy": 1.0, "loss": 0.0, "samples": 2**50},
                                   "nan": {"accuracy": float("nan"), "loss": 1.0, "samples": 5},
                                   "partial": {"accuracy": 0.9}})
    assert out["devices"] == ["a", "b"] and set(out["refused"]) == {"liar", "huge", "nan", "partial"}
    assert out["accuracy"] == pytest.approx((0.5 * 10 + 30) / 40) and out["samples"] == 40
    assert Strategy.evaluate_federated(s, 1, {}) is None
    views = [type("V", (), {"device_id": f"d{i}"})() for i in range(5)]
    assert len(s.configure_evaluate(1, views)) == 3 and s.configure_evaluate(1, views) == s.configure_evaluate(1, views)
    with pytest.raises(ValueError, match="evaluate_fraction"):
        get_strategy("composed")(s.setup, evaluate_fraction=2)


class _Chooser(Composed):
    """Samples the last candidate (or an unknown id) and sends it a personalised state."""

    name = "chooser_for_test"
    pick = "last"

    def sample_devices(self, round, candidates, count, rng):
        return [candidates[-1]] if self.pick == "last" else ["nobody"]

    def state_for(self, device_id, task, experts, model):
        return {k: v + 1.0 for k, v in model.state_for(experts, task).items()}


def test_a_strategy_samples_the_devices_and_decides_what_they_are_sent(tmp_path, monkeypatch):
    from protocol.chunking import split_blob
    from protocol.codec import ENCODING_KEY, encode_tensors

    agg, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "chooser_for_test"}, clients_per_round=2)
    for d in ("a", "b", "c"):
        _hello(agg, d)
    assert agg.engine.start_round() and set(agg.engine.current.selected) == {"c"}
    rnd = agg.engine.current
    personal = agg.engine._sent_state("c", rnd.selected["c"])
    base = agg.model.state_for(rnd.selected["c"], "bbc")
    assert all(torch.equal(personal[k], base[k] + 1.0) for k in base)
    # a zero delta decodes to exactly what this strategy sent, not to the global state
    data = encode_tensors({k: torch.zeros_like(v) for k, v in base.items()}, "fp16", {ENCODING_KEY: "delta"})
    chunks, _ = split_blob(data, 4096, "u-c", "update", rnd.number)
    for c in chunks:
        agg._handle("fl/v1/bd/dev/c/up/update", c)
    got = rnd.updates["c"][1]
    assert all(torch.allclose(got[k], personal[k]) for k in base)
    agg.store.close()

    monkeypatch.setattr(_Chooser, "pick", "unknown")
    agg, _ = _offline(str(tmp_path / "2"), monkeypatch, strategy={"name": "chooser_for_test"}, clients_per_round=2)
    for d in ("a", "b", "c"):
        _hello(agg, d)
    assert not agg.engine.start_round() and "could not sample" in agg.engine.plan_error
    agg.store.close()


def test_a_device_that_fails_after_accepting_finishes_the_round_early(tmp_path, monkeypatch):
    """The device acks, then its training raises and it sends a refusal: the round counts
    it as finished with the device's reason instead of waiting for the deadline."""
    from protocol.messages import Ack

    agg, _ = _offline(str(tmp_path), monkeypatch)
    for d in ("a", "b"):
        _hello(agg, d)
    assert agg.engine.start_round()
    rnd = agg.engine.current

    def ack(d, ok, reason=None):
        msg = Ack(device_id=d, round=rnd.number, accepted=ok, reason=reason)
        agg._handle(f"fl/v1/bd/dev/{d}/up/ack", encode(msg))

    ack("a", True)
    ack("b", True)
    _send(agg, "b", _stats(agg, "b", _upload(agg, "b", 0.01), 10))
    assert not rnd.finished("a")
    ack("a", False, "round failed on device: 'fedprox'")
    ack("a", True)                                   # a late repeat of the acceptance changes nothing
    ack("b", False, "too late")                      # b already reported: its result stands
    assert rnd.finished("a") and rnd.reported("b") and rnd.acks["b"].accepted
    record = agg.engine.close_round()
    assert record["status"] == "ok" and record["failures"] == {"a": "round failed on device: 'fedprox'"}
    agg.store.close()


def test_federated_evaluation_only_from_asked_devices_within_their_declared_data(tmp_path, monkeypatch):
    agg, _ = _offline(str(tmp_path), monkeypatch, strategy={"name": "composed", "params": {"evaluate_fraction": 1.0}})
    _hello(agg, "a")
    _hello(agg, "b")
    _hello(agg, "old", minor=2)          # a minor-2 SDK lacks the term: not asked (it would refuse the round)
    assert agg.engine.start_round()
    rnd = agg.engine.current
    term = agg.engine.strategy.EVALUATION_TERM
    assert [o.name for o in rnd.objectives["a"]] == [term] and "old" not in rnd.objectives

    def ev(acc, n):
        return {f"{term}.accuracy": [acc], f"{term}.loss": [0.5], f"{term}.samples": [n]}

    _send(agg, "a", _stats(agg, "a", _upload(agg, "a", 0.01), 10, extras=ev(0.8, 4)))
    _send(agg, "b", _stats(agg, "b", _upload(agg, "b", 0.01), 10, extras=ev(0.0, 2**40)))   # > its 10 samples
    _send(agg, "old", _stats(agg, "old", _upload(agg, "old", 0.01), 10, extras=ev(0.0, 5)))  # never asked
    fe = agg.engine.close_round()["federated_evaluation"]
    assert fe["devices"] == ["a"] and fe["accuracy"] == pytest.approx(0.8) and fe["samples"] == 4
    assert set(fe["refused"]) == {"b", "old"}
    agg.store.close()
