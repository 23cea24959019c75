"""Bounds on everything a device says: a provisioned, correctly signing device may still lie.

- Parse level: every integer on the wire is inside int64 (tighter where meaningful:
  ``num_samples`` <= 2**40, counts <= 2**62), every float is finite (and probabilities in
  [0, 1], losses and other free-range floats within ``MAX_REAL``), list lengths are
  bounded; anything else is a :class:`MessageError`.
- Engine level: a device's statistics may not claim more samples than its hello declared
  nor more than ``max_samples_per_device``; token, usage and per-expert sample counts are
  bounded by what that many samples can produce; the reply names the numbers, and the
  round still closes with the honest devices.
- Nothing a device can get accepted stops the aggregator: extreme accepted values close a
  round cleanly, stored statistics an older version accepted are checked again on a
  restart, and a 310-digit ``num_samples`` over a real broker is refused with a reply while
  the round completes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from protocol.chunking import split_blob
from protocol.codec import encode_tensors
from protocol.messages import (
    MAX_REAL, MAX_SAMPLES, PROTOCOL_MINOR, Ack, BlobRef, Command, Hello, LayerStats, MessageError, Progress, Stats, encode,
    parse_message,
)
from protocol.topics import Topics
from tests.test_messages import hello, stats_dict
from tests.test_protocol_versions import assignment

HUGE = 10**309  # 310 digits: float(HUGE) raises OverflowError


# --------------------------------------------------------------------------- parse level


def _bases() -> dict[str, dict]:
    st = stats_dict(val_loss=0.5, val_accuracy=0.5, payload_up=1, payload_down=1, predicted_peak_bytes=1,
                    peak_footprint_bytes=1)
    st["layers"][0]["hidden_mean"] = [[0.5, -0.5], [0.1, 0.2], None, None]
    a = json.loads(encode(assignment()))
    a["model"]["config"] = {"hidden_size": 32, "dropout": 0.1}
    return {
        "hello": json.loads(encode(hello(runtime_bytes=1))),
        "ack": json.loads(encode(Ack(device_id="dev-1", round=1, accepted=False, reason="r", budget_bytes=1,
                                     runtime_bytes=1, needed_bytes=1))),
        "stats": st,
        "assignment": a,
        "command": json.loads(encode(Command(command="excluded", round=1, reason="r", budget_bytes=1, needed_bytes=1,
                                             runtime_bytes=1))),
        "progress": json.loads(encode(Progress(event="report", round=1, rounds=2, detail={"x": 1.0, "n": 1}))),
    }


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _field(path) -> str:
    """The field an error names: the free-form dict (its numbers are checked as a whole)
    or the innermost named field."""
    names = [p for p in path if isinstance(p, str)]
    return next((n for n in names if n in ("config", "detail")), names[-1])


def _parse(kind: str, obj) -> object:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_message(raw, {"hello": Hello, "ack": Ack, "stats": Stats, "command": Command,
                               "progress": Progress}.get(kind))


def test_bases_parse():
    for kind, obj in _bases().items():
        _parse(kind, obj)


INT_FIELDS = [
    ("hello", ("protocol_version",)), ("hello", ("protocol_minor",)), ("hello", ("budget_bytes",)),
    ("hello", ("num_samples",)), ("hello", ("runtime_bytes",)),
    ("ack", ("round",)), ("ack", ("attempt",)), ("ack", ("budget_bytes",)), ("ack", ("runtime_bytes",)),
    ("ack", ("needed_bytes",)),
    ("stats", ("round",)), ("stats", ("num_samples",)), ("stats", ("bytes_up",)), ("stats", ("bytes_down",)),
    ("stats", ("payload_up",)), ("stats", ("payload_down",)), ("stats", ("peak_rss_bytes",)),
    ("stats", ("peak_footprint_bytes",)), ("stats", ("baseline_rss_bytes",)), ("stats", ("predicted_peak_bytes",)),
    ("stats", ("update", "bytes")),
    ("stats", ("update", "chunks")), ("stats", ("layers", 0, "layer")), ("stats", ("layers", 0, "tokens")),
    ("stats", ("layers", 0, "usage", 0)), ("stats", ("layers", 0, "expert_samples", 0)),
    ("assignment", ("round",)), ("assignment", ("model_version",)), ("assignment", ("attempt",)),
    ("assignment", ("model", "num_experts")), ("assignment", ("model", "top_k")),
    ("assignment", ("model", "max_seq_len")), ("assignment", ("model", "seed")),
    ("assignment", ("model", "lora", "rank")), ("assignment", ("model", "lora", "seed")),
    ("assignment", ("model", "config", "hidden_size")), ("assignment", ("model", "moe_layers")),
    ("assignment", ("train", "max_steps")), ("assignment", ("train", "batch_size")),
    ("assignment", ("state", "bytes")), ("assignment", ("shards", 0, "bytes")), ("assignment", ("shards", 0, "chunks")),
    ("assignment", ("experts", "1", 0)),
    ("command", ("round",)), ("command", ("budget_bytes",)), ("command", ("needed_bytes",)),
    ("command", ("runtime_bytes",)),
    ("progress", ("round",)), ("progress", ("rounds",)), ("progress", ("detail", "n")),
]


@pytest.mark.parametrize("value", [2**63, -2**63 - 1, HUGE], ids=["int64+1", "int64-1", "310digits"])
@pytest.mark.parametrize("kind, path", INT_FIELDS, ids=[f"{k}.{'.'.join(map(str, p))}" for k, p in INT_FIELDS])
def test_integers_outside_int64_refused(kind, path, value):
    obj = _bases()[kind]
    _set(obj, path, [value] if path == ("model", "moe_layers") else value)
    with pytest.raises(MessageError, match=_field(path)):
        _parse(kind, obj)


def test_310_digit_num_samples_refused():
    raw = json.dumps(stats_dict(num_samples=HUGE)).encode()
    assert len(str(HUGE)) == 310 and len(raw) < 2000
    with pytest.raises(MessageError, match="invalid Stats: num_samples: Input should be less than or equal to "
                                           f"{MAX_SAMPLES}"):
        parse_message(raw, Stats)
    with pytest.raises(MessageError, match="num_samples"):
        parse_message(json.dumps({**_bases()["hello"], "num_samples": HUGE}).encode(), Hello)
    with pytest.raises(MessageError, match="not valid JSON"):  # beyond Python's int-parsing limit: still refused
        parse_message(json.dumps(stats_dict()).replace('"num_samples": 10', '"num_samples": ' + "9" * 5000).encode(),
                      Stats)


def test_num_samples_and_counts_at_their_limits():
    assert parse_message(json.dumps(stats_dict(num_samples=MAX_SAMPLES)).encode(), Stats).num_samples == MAX_SAMPLES
    for kind in ("stats", "hello"):
        with pytest.raises(MessageError, match="num_samples"):
            _parse(kind, {**_bases()[kind], "num_samples": MAX_SAMPLES + 1})
    assert parse_message(json.dumps(stats_dict(bytes_up=2**62)).encode(), Stats).bytes_up == 2**62
    with pytest.raises(MessageError, match="bytes_up"):
        parse_message(json.dumps(stats_dict(bytes_up=2**62 + 1)).encode(), Stats)
    with pytest.raises(MessageError, match="baseline_rss_bytes"):  # memory: bounded like Hello.runtime_bytes
        parse_message(json.dumps(stats_dict(baseline_rss_bytes=2**50 + 1)).encode(), Stats)


def test_command_round_bounded():
    base = _bases()["command"]
    for bad in (2**62 + 1, 2**63, HUGE, -1):
        with pytest.raises(MessageError, match="round"):
            _parse("command", {**base, "round": bad})
    assert _parse("command", {**base, "round": None}).round is None
    with pytest.raises(ValueError):
        Command(command="reject", round=HUGE)


FLOAT_FIELDS = [
    ("stats", ("train_loss",)), ("stats", ("val_loss",)), ("stats", ("val_accuracy",)), ("stats", ("train_seconds",)),
    ("stats", ("layers", 0, "activation_prob", 0)), ("stats", ("layers", 0, "routing_dist", 0)),
    ("stats", ("layers", 0, "margin", 0)), ("stats", ("layers", 0, "expert_loss", 0)),
    ("stats", ("layers", 0, "expert_acc", 0)), ("stats", ("layers", 0, "hidden_mean", 0, 1)),
    ("assignment", ("deadline",)), ("assignment", ("train", "local_epochs")), ("assignment", ("train", "lr")),
    ("assignment", ("train", "weight_decay")), ("assignment", ("train", "prox_mu")),
    ("assignment", ("model", "upcycle_noise")), ("assignment", ("model", "lora", "alpha")),
    ("assignment", ("model", "config", "dropout")),
    ("progress", ("detail", "x")),
]
MARK = "__NUMBER__"


@pytest.mark.parametrize("token", ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1" + "0" * 400])
@pytest.mark.parametrize("kind, path", FLOAT_FIELDS, ids=[f"{k}.{'.'.join(map(str, p))}" for k, p in FLOAT_FIELDS])
def test_non_finite_floats_refused(kind, path, token):
    """``1e999`` is valid JSON that Python reads as inf; the NaN/Infinity constants are
    refused while parsing; a 401-digit integer where a float is due cannot be a float."""
    obj = _bases()[kind]
    _set(obj, path, MARK)
    raw = json.dumps(obj).replace(f'"{MARK}"', token).encode()
    constant = token in ("NaN", "Infinity", "-Infinity")
    with pytest.raises(MessageError, match="non-finite constant" if constant else _field(path)):
        _parse(kind, raw)


def test_non_finite_refused_when_built_in_code_too():
    st = parse_message(json.dumps(stats_dict()).encode(), Stats)
    for field in ("train_loss", "val_loss", "train_seconds"):
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ValueError):
                Stats.model_validate({**st.model_dump(), field: bad})
    with pytest.raises(ValueError):
        LayerStats.model_validate({**st.layers[0].model_dump(), "hidden_mean": [[math.inf], None, None, None]})


@pytest.mark.parametrize("path, value", [
    (("train_loss",), 1e16), (("train_loss",), -1e16), (("val_loss",), -0.5), (("train_seconds",), 1e16),
    (("layers", 0, "activation_prob", 0), 1.5), (("layers", 0, "routing_dist", 0), -0.1),
    (("layers", 0, "margin", 0), 2.0), (("layers", 0, "expert_loss", 0), -1.0), (("layers", 0, "expert_acc", 0), 1.01),
    (("layers", 0, "hidden_mean", 0, 0), 1e16),
])
def test_floats_out_of_range_refused(path, value):
    obj = _bases()["stats"]
    _set(obj, path, value)
    with pytest.raises(MessageError, match=_field(path)):
        _parse("stats", obj)
    obj = _bases()["stats"]
    _set(obj, ("train_loss",), -5.0)  # a composed objective may be negative: only its magnitude is bounded
    assert _parse("stats", obj).train_loss == -5.0


def test_list_lengths_bounded():
    obj = _bases()["stats"]
    obj["shards_fetched"] = ["x" * 65]
    with pytest.raises(MessageError, match="shards_fetched"):
        _parse("stats", obj)
    obj = _bases()["stats"]
    obj["layers"][0]["hidden_mean"][0] = [0.0] * 65537
    with pytest.raises(MessageError, match="hidden_mean"):
        _parse("stats", obj)
    obj = _bases()["stats"]
    obj["layers"] = obj["layers"] * 257
    with pytest.raises(MessageError, match="layers"):
        _parse("stats", obj)
    a = _bases()["assignment"]
    a["experts"] = {"1": list(range(1025))}
    with pytest.raises(MessageError, match="experts"):
        _parse("assignment", a)


def test_deeply_nested_json_is_a_message_error():
    raw = b'{"v": 1, "type": "progress", "event": "report", "detail": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(MessageError, match="not valid JSON"):
        parse_message(raw, Progress)


def test_progress_detail_checked_on_the_wire_only():
    assert math.isnan(Progress(event="round_end", detail={"loss": math.nan}).detail["loss"])  # the cloud's own report
    with pytest.raises(MessageError, match="detail"):
        parse_message(json.dumps({**_bases()["progress"], "detail": {"n": 2**64}}).encode(), Progress)


# --------------------------------------------------------------------------- engine level (offline)


def _offline(tmp, monkeypatch, **cfg_kw):
    """An aggregator without a broker: what it publishes is recorded, replies parsed."""
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from tests.conftest import tiny_spec
    from tests.test_fuzz import _Wire

    cfg = AggregatorConfig(federation="bd", model=tiny_spec(), tasks={"bbc": TaskConfig(labels=["a", "b"])},
                           store=f"sqlite:///{tmp}/agg.db", **cfg_kw)
    agg = Aggregator(cfg, "mqtt://127.0.0.1:1")
    replies: list[tuple[str, Command]] = []

    def record(topic, payload, **kw):
        if topic.endswith("/command"):
            replies.append((topic.split("/")[4], parse_message(payload, Command)))

    for name in ("publish", "publish_nowait"):
        monkeypatch.setattr(agg.transport, name, record)
    agg.engine.wire = _Wire()
    return agg, replies


def _hello(agg, device_id: str, num_samples: int = 10, minor: int = PROTOCOL_MINOR) -> None:
    """A current bbc device's hello straight into the aggregator's handler (``minor``: the
    protocol minor it announces)."""
    h = Hello(device_id=device_id, sdk_version="x", budget_bytes=2**40, weight_formats=["int8"],
              num_samples=num_samples, task="bbc", runtime_bytes=0, protocol_minor=minor)
    agg._handle(f"fl/v1/bd/dev/{device_id}/up/hello", encode(h))


def _upload(agg, device_id: str, value: float = 0.0) -> BlobRef:
    rnd = agg.engine.current
    expected = agg.model.expected_for(rnd.selected[device_id], "bbc")
    data = encode_tensors({k: torch.full(s, value) for k, (s, _) in expected.items()})
    chunks, sha = split_blob(data, 4096, f"u-{device_id}", "update", rnd.number)
    for c in chunks:
        agg._handle(f"fl/v1/bd/dev/{device_id}/up/update", c)
    return BlobRef(transfer_id=f"u-{device_id}", bytes=len(data), sha256=sha, chunks=len(chunks))


def _stats(agg, device_id: str, ref: BlobRef, num_samples: int, tokens: int = 100, **kw) -> Stats:
    """Statistics an honest device could send: usage = tokens x top_k over the experts it holds."""
    rnd, spec = agg.engine.current, agg.model.spec
    E, layers, layer_kw = spec.num_experts, [], kw.pop("layer_kw", {})
    for layer in agg.model.layers:
        held = rnd.selected[device_id][layer]
        usage = [0] * E
        q, r = divmod(tokens * spec.top_k, len(held))
        for i, e in enumerate(held):
            usage[e] = q + (i < r)
        samples = [0] * E
        samples[held[0]] = min(num_samples, 8)
        layers.append(LayerStats(layer=layer, tokens=tokens, usage=usage, activation_prob=[0.5] * E,
                                 routing_dist=[0.5] * E, margin=[0.1] * E, expert_loss=[0.7] * E, expert_acc=[0.5] * E,
                                 expert_samples=samples, **layer_kw))
    args = dict(device_id=device_id, round=rnd.number, task="bbc", num_samples=num_samples, train_loss=0.7,
                layers=layers, update=ref, train_seconds=1.0, bytes_up=1, bytes_down=1, peak_rss_bytes=1,
                baseline_rss_bytes=0, shards_fetched=[])
    args.update(kw)
    return Stats(**args)


def _send(agg, device_id: str, stats: Stats | bytes) -> None:
    agg._handle(f"fl/v1/bd/dev/{device_id}/up/stats", stats if isinstance(stats, bytes) else encode(stats))


def _reasons(replies, device_id):
    return [c.reason for d, c in replies if d == device_id and c.command == "reject"]


def test_stats_claiming_more_than_hello_refused_round_closes_with_honest_device(tmp_path, monkeypatch):
    agg, replies = _offline(str(tmp_path), monkeypatch)
    _hello(agg, "honest", 10)
    _hello(agg, "liar", 10)
    assert agg.engine.start_round()
    rnd = agg.engine.current
    assert set(rnd.selected) == {"honest", "liar"}
    ref = _upload(agg, "liar", 1.0)
    _send(agg, "liar", _stats(agg, "liar", ref, 10**9))             # weight 10**9 vs 10: would own the model
    (reason,) = _reasons(replies, "liar")
    assert reason == "stats rejected: num_samples 1000000000 exceeds the 10 samples its hello declared", reason
    assert "liar" not in rnd.stats and "num_samples 1000000000" in rnd.rejected["liar"]
    _send(agg, "honest", _stats(agg, "honest", _upload(agg, "honest", 0.0), 10))
    assert rnd.reported("honest") and not rnd.reported("liar") and not _reasons(replies, "honest")
    record = agg.engine.close_round()
    assert record["status"] == "ok" and set(record["devices"]) == {"honest"}
    assert "exceeds the 10 samples its hello declared" in record["failures"]["liar"]
    trained = [k for k in agg.model.state if k.startswith("backbone.")]
    assert trained and all(torch.count_nonzero(agg.model.state[k]) == 0 for k in trained)  # the liar's 1.0 never won
    assert agg.internal_errors == 0
    agg.store.close()


def test_configured_maximum_and_token_bounds(tmp_path, monkeypatch):
    agg, replies = _offline(str(tmp_path), monkeypatch, max_samples_per_device=50)
    for d, n in (("big", 60), ("tok", 10), ("use", 10), ("smp", 10), ("ok", 10)):
        _hello(agg, d, n)
    assert agg.engine.start_round()
    rnd, spec = agg.engine.current, agg.model.spec
    seen = math.ceil(10 / 8) * 8                                    # 2 steps of batch 8 over 10 samples
    max_tokens = seen * spec.max_seq_len
    refs = {d: _upload(agg, d) for d in rnd.selected}
    _send(agg, "big", _stats(agg, "big", refs["big"], 60))          # as its hello said, but over the maximum
    _send(agg, "tok", _stats(agg, "tok", refs["tok"], 10, tokens=max_tokens + 1))
    bad_usage = _stats(agg, "use", refs["use"], 10)
    layer = bad_usage.layers[0].model_dump()
    layer["usage"] = [u * 2 for u in layer["usage"]]                # more than tokens x top_k
    _send(agg, "use", bad_usage.model_copy(update={"layers": [LayerStats(**layer)]}))
    layer = _stats(agg, "smp", refs["smp"], 10).layers[0].model_dump()
    layer["expert_samples"] = [seen + 1] + [0] * (spec.num_experts - 1)
    _send(agg, "smp", _stats(agg, "smp", refs["smp"], 10).model_copy(update={"layers": [LayerStats(**layer)]}))
    _send(agg, "ok", _stats(agg, "ok", refs["ok"], 10, tokens=max_tokens))  # the bound itself is fine
    assert _reasons(replies, "big") == ["stats rejected: num_samples 60 exceeds the aggregator's "
                                        "max_samples_per_device 50"]
    assert _reasons(replies, "tok") == [f"stats rejected: layer {layer['layer']}: {max_tokens + 1} tokens exceed the "
                                        f"{max_tokens} that 10 samples can give ({seen} sample visits x max_seq_len "
                                        f"{spec.max_seq_len})"]
    assert "usage 400 exceeds tokens x top_k = 100 x 2" in _reasons(replies, "use")[0]
    assert f"expert_samples {seen + 1} exceed the {seen} sample visits" in _reasons(replies, "smp")[0]
    assert rnd.reported("ok") and not any(rnd.reported(d) for d in ("big", "tok", "use", "smp"))
    _send(agg, "tok", _stats(agg, "tok", refs["tok"], 10))          # refused stats are not kept: honest ones may follow
    assert rnd.reported("tok")
    record = agg.engine.close_round()
    assert set(record["devices"]) == {"ok", "tok"} and record["status"] == "no_quorum"  # 2 of 5, quorum 3
    agg.store.close()


def test_extreme_accepted_values_close_the_round_cleanly(tmp_path, monkeypatch):
    """The largest values the schema and the engine accept cannot make closing a round raise
    (screening and the step guard off: the arithmetic itself is under test)."""
    cap = 10**6
    agg, _ = _offline(str(tmp_path), monkeypatch, max_samples_per_device=cap,
                      defences={"screening": None, "guard": None})
    for d in ("a", "b"):
        _hello(agg, d, MAX_SAMPLES)
    assert agg.engine.start_round()
    spec = agg.model.spec
    max_tokens = math.ceil(cap / 8) * 8 * spec.max_seq_len
    E = spec.num_experts
    for d, loss in (("a", MAX_REAL), ("b", -MAX_REAL)):
        ref = _upload(agg, d, 1.0 if d == "a" else 0.0)
        _send(agg, d, _stats(agg, d, ref, cap, tokens=max_tokens, train_loss=loss, val_loss=MAX_REAL,
                             train_seconds=MAX_REAL, bytes_up=2**62, bytes_down=2**62, payload_up=2**62,
                             payload_down=2**62, peak_rss_bytes=2**50, predicted_peak_bytes=2**62,
                             layer_kw={"hidden_mean": [[MAX_REAL, -MAX_REAL]] * E}))
    rnd = agg.engine.current
    assert rnd.reported("a") and rnd.reported("b"), rnd.rejected
    record = agg.engine.close_round()
    assert record["status"] == "ok" and record["bytes_up"] == 2**63 and record["train_loss"] == 0.0
    assert agg.store.rounds()[-1]["status"] == "ok"
    backbone = [v for k, v in agg.model.state.items() if k.startswith("backbone.")]
    assert all(torch.allclose(v, torch.full_like(v, 0.5)) for v in backbone)  # equal weights, no overflow
    agg.store.close()


def test_restart_drops_stored_stats_an_older_version_accepted(tmp_path, monkeypatch):
    """Before these bounds, a 310-digit num_samples was accepted and stored; closing the
    round raised, and a restart resumed the round and raised again. Now a restart checks
    the stored statistics again, drops them, and the round completes."""
    from cloud.service import Aggregator
    from tests.test_fuzz import _Wire

    agg, _ = _offline(str(tmp_path), monkeypatch)
    _hello(agg, "d0", 10)
    assert agg.engine.start_round()
    rnd = agg.engine.current
    ref = _upload(agg, "d0")
    bad = _stats(agg, "d0", ref, 10).model_dump(mode="json")
    bad["num_samples"] = HUGE
    agg.store.put_json(f"inflight/{rnd.number}/stats/d0", bad)     # as an older aggregator stored it
    agg.store.close()
    agg2 = Aggregator(agg.cfg, "mqtt://127.0.0.1:1")                # must not raise
    agg2.engine.wire = _Wire()
    rnd2 = agg2.engine.current
    assert rnd2.number == rnd.number and "d0" in rnd2.updates and "d0" not in rnd2.stats
    assert "num_samples" in rnd2.rejected["d0"]
    assert agg2.store.get_json(f"inflight/{rnd.number}/stats/d0") is None
    monkeypatch.setattr(agg2.transport, "publish", lambda *a, **kw: None)
    _send(agg2, "d0", _stats(agg2, "d0", ref, 10))                  # the device sends honest stats again
    assert rnd2.reported("d0")
    assert agg2.engine.close_round()["status"] == "ok"
    agg2.store.close()


# --------------------------------------------------------------------------- end to end (Mosquitto)


def _liar(fed, replies: list, assignments: list) -> None:
    """A rogue device: says hello with 50 samples, then sends a stats message claiming 51,
    and one with a 310-digit num_samples, then refuses its assignment (so the round closes
    as soon as the honest device reported)."""
    from protocol.transport import Transport
    from tests.federation import drain_downlink

    t = Topics(fed.federation)
    tr = Transport(fed.url, f"rogue-liar-{fed.federation}", protocol=fed.protocol).connect()
    try:
        assert tr.subscribe(t.device_down("liar"), timeout=10)
        tr.publish(t.up("liar", "hello"), encode(Hello(device_id="liar", sdk_version="x", budget_bytes=2**40,
                                                         weight_formats=["int8"], num_samples=50, task="bbc",
                                                         runtime_bytes=0)))
        drain_downlink(tr, 60, replies, assignments, until=lambda: bool(assignments))
        a = assignments[0]
        E, layers = a.model.num_experts, []
        for layer, held in sorted(a.experts.items()):
            usage = [10 if e in held else 0 for e in range(E)]
            layers.append(LayerStats(layer=layer, tokens=40, usage=usage, activation_prob=[0.0] * E,
                                     routing_dist=[0.0] * E, margin=[0.0] * E, expert_loss=[None] * E,
                                     expert_acc=[None] * E, expert_samples=[0] * E))
        ref = BlobRef(transfer_id="lie", bytes=10, sha256="a" * 64, chunks=1)
        stats = Stats(device_id="liar", round=a.round, task="bbc", num_samples=51, train_loss=1.0, layers=layers,
                      update=ref, train_seconds=1.0, bytes_up=1, bytes_down=1, peak_rss_bytes=1, baseline_rss_bytes=0,
                      shards_fetched=[])
        tr.publish(t.up("liar", "stats"), encode(stats))
        drain_downlink(tr, 20, replies, assignments, until=lambda: len(replies) >= 1)
        huge = json.loads(encode(stats))
        huge["num_samples"] = HUGE
        tr.publish(t.up("liar", "stats"), json.dumps(huge).encode())
        drain_downlink(tr, 20, replies, assignments, until=lambda: len(replies) >= 2)
        tr.publish(t.up("liar", "ack"), encode(Ack(device_id="liar", round=a.round, accepted=False,
                                                   reason="sitting out", attempt=a.attempt)))
    finally:
        tr.close()


@pytest.mark.slow
def test_lying_device_over_mosquitto_is_refused_and_round_completes(mosquitto_url, tmp_path):
    from tests.federation import Federation

    replies, assignments = [], []
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2,), min_devices=2, round_timeout_s=60)
    (rec,) = fed.run(extra=lambda f: _liar(f, replies, assignments), timeout=120)
    assert replies[0] == "stats rejected: num_samples 51 exceeds the 50 samples its hello declared", replies
    assert replies[1].startswith("stats rejected: invalid Stats: num_samples: Input should be less than or equal "
                                 f"to {MAX_SAMPLES}"), replies
    assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0"} and rec["round"] == 1
    assert "exceeds the 50 samples its hello declared" in rec["failures"]["liar"]
    assert fed.aggregator.internal_errors == 0


def test_rejects_name_the_kind_round_and_upload_they_refer_to(tmp_path, monkeypatch):
    """A schema failure still tells the device which message failed: the kind, the round and
    the update's transfer id its bytes show; an unknown task is refused at hello (with a
    reply) and the device is never registered, so it does not count as online."""
    agg, replies = _offline(str(tmp_path), monkeypatch)
    h = Hello(device_id="stranger", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"], num_samples=10,
              task="no-such-task", runtime_bytes=0)
    agg._handle("fl/v1/bd/dev/stranger/up/hello", encode(h))
    assert agg.registry.get("stranger") is None and agg.registry.online() == []
    (reply,) = [c for d, c in replies if d == "stranger"]
    assert reply.command == "reject" and reply.kind == "hello" and "unknown task 'no-such-task'" in reply.reason

    _hello(agg, "dev-1")
    assert agg.engine.start_round()
    bad = json.loads(encode(_stats(agg, "dev-1", _upload(agg, "dev-1"), 10)))
    bad["num_samples"] = "10"  # no coercion: a string is not an integer
    replies.clear()
    _send(agg, "dev-1", json.dumps(bad).encode())
    (reply,) = replies
    assert reply[1].kind == "stats" and reply[1].round == 1 and reply[1].upload_id == "u-dev-1"
    assert "num_samples" in reply[1].reason

    replies.clear()  # an update chunk for a stale round: the chunk header names it
    chunks, _ = split_blob(b"\0" * 3000, 4096, "late-7", "update", 0)
    agg._handle("fl/v1/bd/dev/dev-1/up/update", chunks[0])
    (reply,) = replies
    assert (reply[1].kind, reply[1].round, reply[1].upload_id) == ("update", 0, "late-7")

    replies.clear()  # bytes that show nothing: the kind only
    agg._handle("fl/v1/bd/dev/dev-1/up/ack", b"\xff not json")
    (reply,) = replies
    assert (reply[1].kind, reply[1].round, reply[1].upload_id) == ("ack", None, None)


def test_state_in_a_lossy_precision_goes_only_to_devices_that_decode_it(tmp_path, monkeypatch):
    """``state_precision`` int8 reaches a minor-4 device as int8; a minor-3 device (whose SDK
    predates per-column scales) gets its state in fp32 instead of one it cannot decode."""
    from protocol.codec import decode_tensors
    from protocol.messages import MIN_MINOR_FOR_STATE_PRECISION

    agg, _ = _offline(str(tmp_path), monkeypatch, state_precision="int8")
    blobs = {}
    record = agg.engine.wire.publish_blob
    monkeypatch.setattr(agg.engine.wire, "publish_blob", lambda topic, data, kind, round, transfer_id=None: (
        blobs.__setitem__(topic.split("/")[4], data), record(topic, data, kind, round, transfer_id))[1])
    _hello(agg, "new", minor=MIN_MINOR_FOR_STATE_PRECISION)
    _hello(agg, "old", minor=MIN_MINOR_FOR_STATE_PRECISION - 1)
    assert agg.engine.start_round()
    fmts = {}
    for d, data in blobs.items():
        meta: dict[str, str] = {}
        decode_tensors(data, 2**26, metadata_out=meta)
        fmts[d] = meta["format"]
    assert fmts == {"new": "int8", "old": "fp32"}
