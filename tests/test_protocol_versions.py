"""Protocol evolution: ``v`` is the major version, a minor version only adds.

Same major version: unknown fields (a newer minor) are ignored, both ways; another major
version is refused with a reason that names both versions; types are checked strictly on
the wire; configuration files still reject unknown keys.
"""

import json
import logging
import time
import uuid
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from protocol.messages import (
    PROTOCOL_MINOR, PROTOCOL_VERSION, Ack, Assignment, BlobRef, Command, Hello, MessageError, ModelSpec,
    ShardManifest, Stats, TrainConfig, VersionError, encode, parse_message,
)
from protocol.topics import Topics
from tests.test_messages import SHA, hello, stats_dict

NEWER = (f"protocol major version 2 is not supported (this peer speaks {PROTOCOL_VERSION}.{PROTOCOL_MINOR}; "
         "same-major messages with unknown fields are accepted)")


def _with(msg, **extra) -> bytes:
    d = json.loads(encode(msg)) if not isinstance(msg, dict) else dict(msg)
    d.update(extra)
    return json.dumps(d).encode()


def assignment() -> Assignment:
    return Assignment(
        round=3, model_version=2, model=ModelSpec(num_experts=4, top_k=2), task="bbc", labels=["a", "b"],
        experts={1: [0, 3], 3: [2]}, weight_format="int8", train=TrainConfig(lr=0.01), deadline=1.7e9,
        shards=[ShardManifest(shard_id="L1.E0", topic="fl/v1/x/shards/2/1/0", bytes=10, sha256=SHA,
                              format="int8", chunks=1)],
        state=BlobRef(transfer_id="s", bytes=1, sha256=SHA, chunks=1))


def test_versions():
    assert (PROTOCOL_VERSION, PROTOCOL_MINOR) == (1, 13)
    assert hello().protocol_minor == 0 and hello().protocol_version == PROTOCOL_VERSION  # absent: a 1.0 device
    for bad in (-1, 10_001):
        with pytest.raises(MessageError, match="protocol_minor"):
            parse_message(_with(hello(), protocol_minor=bad), Hello)


# --------------------------------------------------------------------------- (a) cloud reads newer devices


def test_cloud_parses_newer_minor_messages():
    h = parse_message(_with(hello(), protocol_minor=99, battery={"level": 0.5}), Hello)
    assert h.protocol_minor == 99 and h == hello(protocol_minor=99)
    assert "battery" not in h.model_dump()                     # ignored, not kept

    d = stats_dict(energy_joules=12.5)
    d["layers"][0]["router_entropy"] = [0.1, 0.2, 0.0, 0.0]  # unknown fields nested anywhere
    d["update"]["compression"] = "zstd"
    s = parse_message(json.dumps(d).encode(), Stats)
    assert s == parse_message(json.dumps(stats_dict()).encode(), Stats)
    assert "router_entropy" not in s.layers[0].model_dump() and "compression" not in s.update.model_dump()

    ack = Ack(device_id="dev-1", round=2, accepted=False, reason="memory")
    assert parse_message(_with(ack, thermal="hot"), Ack) == ack


def _offline_aggregator(tmp, monkeypatch):
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from tests.conftest import tiny_spec

    cfg = AggregatorConfig(federation="pv", model=tiny_spec(), tasks={"bbc": TaskConfig(labels=["a", "b"])},
                           store=f"sqlite:///{tmp}/agg.db")
    agg = Aggregator(cfg, "mqtt://127.0.0.1:1")
    sent = []
    for name in ("publish", "publish_nowait"):
        monkeypatch.setattr(agg.transport, name, lambda topic, payload, **kw: sent.append((topic, payload)))
    return agg, sent


def test_aggregator_accepts_newer_minor_hello_and_refuses_other_major(tmp_path, monkeypatch, caplog):
    agg, sent = _offline_aggregator(str(tmp_path), monkeypatch)
    caplog.set_level(logging.INFO, logger="cloud.registry")
    h = hello(device_id="d1", task="bbc")
    for _ in range(2):                                         # retained hellos come again: log once
        agg._handle("fl/v1/pv/dev/d1/up/hello", _with(h, protocol_minor=99, new_field=[1, 2]))
    assert agg.registry.get("d1") is not None and agg.rejected == 0
    assert [parse_message(p, Command).command for _, p in sent] == ["registered"] * 2  # minor 10: the hello is answered
    sent.clear()
    notes = [r for r in caplog.records if "speaks protocol" in r.getMessage()]
    assert len(notes) == 1 and "protocol 1.99" in notes[0].getMessage() and notes[0].levelno == logging.INFO

    agg._handle("fl/v1/pv/dev/d2/up/hello", _with(hello(device_id="d2", task="bbc"), v=2, protocol_version=2))
    assert agg.registry.get("d2") is None and agg.rejected == 1
    ((topic, payload),) = sent
    assert topic == "fl/v1/pv/dev/d2/down/command"
    reply = parse_message(payload, Command)
    assert reply.command == "reject" and reply.reason == f"hello rejected: {NEWER}"


# --------------------------------------------------------------------------- (b) devices read a newer cloud


def test_device_parses_newer_minor_assignment_and_command():
    a = assignment()
    d = json.loads(encode(a))
    d["priority"] = "high"
    d["model"]["moe_style"] = "fine-grained"
    d["model"]["lora"]["dropout"] = 0.1
    d["train"]["scheduler"] = "cosine"
    d["shards"][0]["compression"] = "zstd"
    d["state"]["codec"] = "x"
    assert parse_message(json.dumps(d).encode(), Assignment) == a  # int layer keys survive strict parsing

    c = parse_message(_with(Command(command="reject", round=3, reason="r"), hint="retry later"), Command)
    assert c == Command(command="reject", round=3, reason="r")
    assert parse_message(_with(Command(command="stop"), command="migrate"), Command).command == "migrate"


def _pump_stub(messages):
    from edge_sdk.client import _Inbox

    q = list(messages)
    get = lambda timeout: SimpleNamespace(topic=q[0][0], payload=q.pop(0)[1])  # noqa: E731
    from protocol.logsafe import LogLimiter

    limiters = {name: LogLimiter(logging.getLogger("edge_sdk.client"), per_key=k, total=10, interval_s=3600.0)
                for name, k in (("_reject_log", 3), ("_version_log", 1))}
    return SimpleNamespace(device_id="dev-1", topics=Topics("pv"), _inbox=_Inbox(), transport=SimpleNamespace(get=get),
                           **limiters)


def test_device_pump_logs_other_major_once_and_ignores_unknown_commands(caplog):
    from edge_sdk.client import EdgeClient

    down = "fl/v1/pv/dev/dev-1/down/"
    a2 = _with(assignment(), v=2)
    msgs = [(down + "assignment", a2), (down + "assignment", a2), (down + "command", _with(Command(command="stop"),
                                                                                           v=2)),
            (down + "assignment", _with(assignment(), v=3)), (down + "command", _with(Command(command="stop"), v=2)),
            (down + "command", _with(Command(command="migrate"), zone="eu"))]
    stub = _pump_stub(msgs)
    caplog.set_level(logging.DEBUG, logger="edge_sdk.client")
    for _ in msgs:
        assert EdgeClient._pump(stub, 0)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, errors                           # (assignment, 2), (command, 2), (assignment, 3)
    assert NEWER in errors[0] and "assignment" in errors[0]
    assert "protocol major version 3 is not supported" in errors[2]
    (cmd,) = stub._inbox.controls                              # the unknown command of a newer minor is read...
    assert cmd.command == "migrate"
    stub.notices, stub._stop = [], False
    caplog.clear()
    EdgeClient._on_command(stub, cmd)                          # ...and ignored: no notice, no warning, no stop
    assert stub.notices == [] and stub._stop is False
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- (c) another major, both ways


@pytest.mark.parametrize("cls, msg", [
    (Hello, hello()), (Ack, Ack(device_id="dev-1", round=1, accepted=True)), (Assignment, assignment()),
    (Command, Command(command="stop")),
])
def test_other_major_refused(cls, msg):
    with pytest.raises(VersionError, match=NEWER.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as e:
        parse_message(_with(msg, v=2), cls)
    assert e.value.version == "2"
    for v in ("1", True, 1.0, None):
        with pytest.raises(VersionError, match="must be an integer major version"):
            parse_message(_with(msg, v=v), cls)


def test_end_to_end_over_mosquitto(mosquitto_url, tmp_path, caplog):
    """A rogue client publishes retained hellos: one of minor 99 with an unknown field
    (registered), one of major 2 (refused, the reply names the versions)."""
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from protocol.transport import Transport
    from tests.conftest import tiny_spec
    from tests.federation import drain_downlink

    fed = f"pv{uuid.uuid4().hex[:8]}"
    cfg = AggregatorConfig(federation=fed, model=tiny_spec(), tasks={"bbc": TaskConfig(labels=["a", "b"])},
                           store=f"sqlite:///{tmp_path}/agg.db")
    agg = Aggregator(cfg, mosquitto_url)
    t = Topics(fed)
    rogue = Transport(mosquitto_url, f"rogue-{fed}").connect()
    caplog.set_level(logging.INFO, logger="cloud.registry")  # the logger that names the version, whatever
    try:                                                      # an earlier test set on "cloud"
        agg.transport.connect()
        assert agg.transport.subscribe(t.all_up(), timeout=10)
        assert rogue.subscribe(t.device_down("old"), timeout=10)
        rogue.publish(t.up("new", "hello"), _with(hello(device_id="new", task="bbc"), protocol_minor=99,
                                                  sensors=["imu"]), retain=True)
        rogue.publish(t.up("old", "hello"), _with(hello(device_id="old", task="bbc"), v=2), retain=True)
        replies, assignments = [], []
        end = time.time() + 20
        while time.time() < end and not (agg.registry.get("new") and replies):
            agg._pump(0.2)
            drain_downlink(rogue, 0.05, replies, assignments)
        assert agg.registry.get("new") is not None and agg.registry.get("old") is None
        assert replies == [f"hello rejected: {NEWER}"], replies
        assert any("device new speaks protocol 1.99" in r.getMessage() for r in caplog.records)
    finally:
        for dev in ("new", "old"):
            rogue.publish(t.up(dev, "hello"), b"", retain=True)  # clear the retained hellos
        rogue.close()
        agg.transport.close(end_session=True)
        agg.store.close()


# --------------------------------------------------------------------------- (d) configuration stays strict


def test_aggregator_config_rejects_unknown_keys(tmp_path):
    from cloud.service import AggregatorConfig

    base = "tasks: {bbc: {labels: [a, b]}}\nmodel: {num_experts: 4, top_k: 2}\ntrain: {lr: 1e-3, batch_size: 4}\n"
    path = tmp_path / "agg.yaml"
    path.write_text(base)
    cfg = AggregatorConfig.load(path)
    assert cfg.train.lr == 1e-3 and cfg.model.num_experts == 4   # YAML reads 1e-3 as a string: coerced
    path.write_text(base.replace("lr: 1e-3", "lr: 1"))
    assert AggregatorConfig.load(path).train.lr == 1.0
    for text, where in ((base.replace("num_experts:", "num_expert:"), "model.num_expert"),
                        (base.replace("lr:", "lrr:"), "train.lrr"), ("roundz: 3\n" + base, "roundz")):
        path.write_text(text)
        with pytest.raises(ValidationError, match="Extra inputs") as e:
            AggregatorConfig.load(path)
        assert f"\n{where}\n" in str(e.value), (where, str(e.value))
    with pytest.raises(ValidationError, match="Extra inputs"):
        ModelSpec(num_expert=4)
    with pytest.raises(ValidationError, match="Extra inputs"):
        TrainConfig(lrr=0.1)


# --------------------------------------------------------------------------- (e) strict types on the wire


def test_strict_types():
    with pytest.raises(MessageError, match="round"):
        parse_message(json.dumps(stats_dict(round="1")).encode(), Stats)
    ack = json.loads(encode(Ack(device_id="dev-1", round=1, accepted=True)))
    for field, bad in (("accepted", 1), ("accepted", "true"), ("round", "1"), ("round", 1.0), ("attempt", False)):
        with pytest.raises(MessageError, match=f"invalid Ack: {field}"):
            parse_message(json.dumps({**ack, field: bad}).encode(), Ack)
    assert parse_message(json.dumps(ack).encode(), Ack).accepted is True
    # a JSON integer is a valid float
    assert parse_message(json.dumps(stats_dict(train_loss=1, val_loss=0)).encode(), Stats).train_loss == 1.0
    d = json.loads(encode(assignment()))
    d["deadline"] = 1700000000
    assert parse_message(json.dumps(d).encode(), Assignment).deadline == 1.7e9
    d["experts"] = {"1": ["0"]}
    with pytest.raises(MessageError, match="experts"):
        parse_message(json.dumps(d).encode(), Assignment)
    d["experts"] = {"one": [0]}
    with pytest.raises(MessageError, match="experts"):
        parse_message(json.dumps(d).encode(), Assignment)
