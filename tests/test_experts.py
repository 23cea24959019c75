"""protocol.experts: the one typed form of an expert assignment (layer -> sorted expert ids)
and its JSON form; the engine's stored forms are those the ad hoc conversions wrote."""

from __future__ import annotations

import copy
import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from protocol.experts import (
    Experts, experts_by_device_from_json, experts_by_device_to_json, layer_key, layers_from_json, layers_to_json,
)
from protocol.messages import Assignment, BlobRef, MessageError, ModelSpec, TrainConfig, encode, parse_message
from tests.test_bounds import _hello, _send, _stats, _upload

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_and_helpers():
    e = Experts({"3": [2], 1: (3, 0)})
    assert isinstance(e, dict) and e == {3: [2], 1: [0, 3]} and list(e) == [3, 1]   # layer order kept
    assert repr(e) == "Experts({3: [2], 1: [0, 3]})"
    assert e.to_json() == {"3": [2], "1": [0, 3]}
    assert json.dumps(e.to_json()) == '{"3": [2], "1": [0, 3]}'
    assert Experts.from_json(e.to_json()) == e and Experts(e) == e
    assert e.counts() == {3: 1, 1: 2} and e.total() == 3
    plain = e.as_dict()
    assert type(plain) is dict and plain == e
    plain[1].append(5)
    assert e[1] == [0, 3]                                                              # a copy
    assert Experts() == {} and Experts(None).to_json() == {} and Experts({0: []}).total() == 0
    assert Experts({np.int64(2): [np.int64(1), np.int32(0)]}) == {2: [0, 1]}
    for c in (copy.copy(e), copy.deepcopy(e), pickle.loads(pickle.dumps(e))):
        assert type(c) is Experts and c == e


def test_read_only():
    e = Experts({1: [0]})
    for mutate in (lambda: e.__setitem__(2, [1]), lambda: e.__delitem__(1), lambda: e.update({2: [1]}),
                   lambda: e.pop(1), lambda: e.popitem(), lambda: e.clear(), lambda: e.setdefault(2, [])):
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    with pytest.raises(TypeError, match="read-only"):
        e |= {2: [1]}
    assert e == {1: [0]}


@pytest.mark.parametrize("value,problem", [
    ([(1, [0])], "experts must be a mapping, got list"),
    ({"a": [0]}, "layer key 'a' is not a layer index"),
    ({"-1": [0]}, "layer key '-1'"),
    ({" 1": [0]}, "layer key ' 1'"),
    ({"": [0]}, "layer key ''"),
    ({"1234567890": [0]}, "layer key '1234567890'"),
    ({"١": [0]}, "layer key '١'"),                                   # a non-ASCII digit
    ({-1: [0]}, "layer key -1"),
    ({True: [0]}, "layer key True"),
    ({1.0: [0]}, "layer key 1.0"),
    ({1: [0], "1": [1]}, "layer 1 is given twice"),
    ({1: "01"}, "layer 1: expert ids must be a list of ints, got str"),
    ({1: 3}, "layer 1: expert ids must be a list of ints, got int"),
    ({1: {0: 1}}, "layer 1: expert ids must be a list of ints, got dict"),
    ({1: [True]}, "layer 1: expert id True is not an int"),
    ({1: [1.0]}, "layer 1: expert id 1.0 is not an int"),
    ({1: ["1"]}, "layer 1: expert id '1' is not an int"),
    ({1: [-2]}, "layer 1: expert id -2 is negative"),
    ({1: [3, 0, 3]}, "layer 1: expert 3 is listed twice"),
])
def test_validation_errors(value, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        Experts(value)


def test_layer_keys_and_by_device_forms():
    assert layer_key("007") == 7 and layer_key(0) == 0 and layer_key(np.uint8(4)) == 4
    rows = [0.5, 0.5]
    assert layers_to_json({2: rows})["2"] is rows and layers_from_json({"2": rows})[2] is rows   # values as given
    with pytest.raises(ValueError, match="a per-layer mapping must be a mapping"):
        layers_from_json([1])
    by_device = {"b": {"1": [2, 0]}, "a": {"0": [1], "1": [3]}}
    read = experts_by_device_from_json(by_device)
    assert list(read) == ["b", "a"] and all(type(e) is Experts for e in read.values())
    assert read == {"b": {1: [0, 2]}, "a": {0: [1], 1: [3]}}
    assert experts_by_device_to_json(read) == {"b": {"1": [0, 2]}, "a": {"0": [1], "1": [3]}}
    assert experts_by_device_to_json({"x": {1: [1, 0]}}) == {"x": {"1": [0, 1]}}        # plain dicts too
    with pytest.raises(ValueError, match="device a: layer 1: expert 3 is listed twice"):
        experts_by_device_from_json({"a": {"1": [3, 3]}})


def _assignment(experts) -> Assignment:
    return Assignment(round=1, model_version=0, model=ModelSpec(num_experts=4, top_k=2), task="bbc",
                      labels=["a", "b"], experts=experts, shards=[], weight_format="int8",
                      state=BlobRef(transfer_id="t", bytes=1, sha256="0" * 64, chunks=1), train=TrainConfig(),
                      deadline=1.0)


def test_assignment_wire_format_unchanged():
    plain = _assignment({1: [0, 3], 3: [2]})
    typed = _assignment(Experts({1: [0, 3], 3: [2]}))
    assert encode(typed) == encode(plain) and b'"experts":{"1":[0,3],"3":[2]}' in encode(plain)
    back = parse_message(encode(plain), Assignment)
    assert back.experts == {1: [0, 3], 3: [2]} and Experts(back.experts) == plain.experts
    d = json.loads(encode(plain))
    d["experts"] = {"x1": [0]}
    with pytest.raises(MessageError, match="experts"):
        parse_message(json.dumps(d).encode(), Assignment)


def _offline(tmp_path, monkeypatch):
    """An aggregator without a broker (tests.test_bounds._offline) on a model with two MoE layers."""
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from tests.conftest import tiny_spec
    from tests.test_fuzz import _Wire

    cfg = AggregatorConfig(federation="bd", model=tiny_spec(moe_layers=[0, 1]),
                           tasks={"bbc": TaskConfig(labels=["a", "b"])}, store=f"sqlite:///{tmp_path}/agg.db")
    agg = Aggregator(cfg, "mqtt://127.0.0.1:1")
    for name in ("publish", "publish_nowait"):
        monkeypatch.setattr(agg.transport, name, lambda *a, **k: None)
    agg.engine.wire = _Wire()
    return agg


def _old_to_json(by_device):
    """What the engine wrote before protocol.experts (the ad hoc conversion)."""
    return {d: {str(k): v for k, v in e.items()} for d, e in by_device.items()}


def _round(agg):
    for d in ("a", "b"):
        _send(agg, d, _stats(agg, d, _upload(agg, d, 0.01), 10))
    record = agg.engine.close_round()
    assert record["status"] == "ok"
    return record


def test_engine_stored_forms_are_unchanged_and_resume(tmp_path, monkeypatch):
    full = {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}                  # budgets hold every expert
    agg = _offline(tmp_path, monkeypatch)
    for d in ("a", "b"):
        _hello(agg, d)
    assert agg.engine.start_round()
    rnd = agg.engine.current
    assert all(type(e) is Experts for e in rnd.selected.values())
    selected = agg.store.get_json("current_round")["selected"]
    assert selected == {"a": full, "b": full}
    assert json.dumps(selected) == json.dumps(_old_to_json(rnd.selected))
    record = _round(agg)
    assert record["devices"]["a"]["experts"] == full and list(record["expert_load"]) == ["0", "1"]
    assert list(record["cv_per_layer"]) == ["0", "1"]
    prev = agg.store.get_json("previous_assignment")
    assert prev == {"a": full, "b": full} and json.dumps(prev) == json.dumps(_old_to_json(agg.engine.previous))
    assert agg.store.get_json("strategy_state")["assignment"] == {}   # random_kept recomputes its draws
    assert list(agg.store.get_json("load_window")["history"][0]) == ["0", "1"]
    assert agg.engine.start_round()                                 # round 2 in flight, then the aggregator stops
    stored = {k: agg.store.get_json(k) for k in ("previous_assignment", "current_round", "strategy_state",
                                                 "load_window")}
    agg.store.close()

    again = _offline(tmp_path, monkeypatch)
    eng = again.engine
    assert eng.previous == {d: {int(k): v for k, v in e.items()} for d, e in prev.items()}
    assert all(type(e) is Experts for e in [*eng.previous.values(), *eng.current.selected.values()])
    assert eng.current.number == 2 and eng.current.selected == rnd.selected
    assert json.dumps(eng.strategy.state_dict()) == json.dumps(stored["strategy_state"])
    assert json.dumps(eng.window.state_dict()) == json.dumps(stored["load_window"])
    _round(again)                                                   # the resumed engine writes the same forms
    assert again.store.get_json("previous_assignment") == stored["previous_assignment"]
    assert again.store.get_json("strategy_state")["assignment"] == stored["strategy_state"]["assignment"]
    again.store.close()


_CONVERSION = re.compile(r"\{\s*(?:str|int)\(\s*(\w+)\s*\)[^{}]*?\bfor\s+\1\s*,\s*\w+\s+in\b")
"""A dict comprehension converting the loop's keys with str()/int(): ``{str(k): v for k, v in e.items()}``."""
_ALLOWED = {("cloud/robust/screening.py", "self.references = {str(k): float(v)")}
"""(file, line start) of conversions of keys that are not layers (screening's references are keyed by kind)."""


def test_no_ad_hoc_layer_key_conversion_remains():
    old = ["{str(k): v for k, v in e.items()}", "{d: {int(k): v for k, v in e.items()} for d, e in m.items()}",
           "{int(k): sorted(int(e) for e in v) for k, v in experts.items()}",
           "{int(k) if isinstance(k, str) and k.isdigit() else k: x\n for k, x in v.items()}",
           "{str(layer): rows for layer, rows in self.q.items()}"]
    assert all(_CONVERSION.search(s) for s in old)                 # the check can fail
    found = []
    for pkg in ("protocol", "moe_model", "edge_sdk", "cloud"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "protocol/experts.py":
                continue
            text = path.read_text(encoding="utf-8")
            for m in _CONVERSION.finditer(text):
                line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.start())].strip()
                if not any(rel == f and line.startswith(start) for f, start in _ALLOWED):
                    found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {line}")
    assert not found, "use protocol.experts (Experts, layers_to_json/layers_from_json):\n" + "\n".join(found)
