import json

import pytest

from protocol.messages import MAX_CONTROL_BYTES, Assignment, BlobRef, Hello, MessageError, Stats, \
    encode, parse_message

SHA = "a" * 64


def hello(**kw):
    d = dict(device_id="dev-1", sdk_version="0.1", budget_bytes=2**30, weight_formats=["int8"], num_samples=10,
             task="bbc")
    d.update(kw)
    return Hello(**d)


def layer(**kw):
    d = dict(layer=1, tokens=10, usage=[5, 5, 0, 0], activation_prob=[.5, .5, 0, 0], routing_dist=[.5, .5, 0, 0],
             margin=[.1, .2, 0, 0], expert_loss=[1.0, 1.0, None, None], expert_acc=[.5, .5, None, None],
             expert_samples=[1, 1, 0, 0])
    d.update(kw)
    return d


def stats_dict(**kw):
    d = dict(v=1, type="stats", device_id="dev-1", round=1, task="bbc", num_samples=10, train_loss=1.0,
             layers=[layer()], update=dict(transfer_id="u1", bytes=10, sha256=SHA, chunks=1), train_seconds=1.0,
             bytes_up=1, bytes_down=1, peak_rss_bytes=1, baseline_rss_bytes=1, shards_fetched=[])
    d.update(kw)
    return d


def test_round_trip():
    h = hello()
    assert parse_message(encode(h), Hello) == h
    s = parse_message(json.dumps(stats_dict()).encode(), Stats)
    assert s.layers[0].usage == [5, 5, 0, 0]


@pytest.mark.parametrize("payload, match", [
    (b"not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1,2]", "JSON object"),
    (b'{"v": 2, "type": "hello"}', "protocol major version 2 is not supported"),
    (b'{"v": true, "type": "hello"}', "must be an integer"),
    (b'{"v": "1", "type": "hello"}', "must be an integer"),
    (b'{"type": "hello"}', "must be an integer"),
    (b'{"v": 1, "type": "nope"}', "unknown message type"),
    (b'{"v": 1, "type": "hello"}', "invalid Hello"),
])
def test_malformed_rejected(payload, match):
    with pytest.raises(MessageError, match=match):
        parse_message(payload, Hello)


def test_wrong_type_for_topic():
    with pytest.raises(MessageError, match="expected a Stats"):
        parse_message(encode(hello()), Stats)


def test_schema_violations():
    bad = [
        dict(device_id="a/b"),         # topic separator in id
        dict(device_id="+"),           # wildcard
        dict(budget_bytes=0),
        dict(weight_formats=[]),
        dict(weight_formats=["int3"]),
        dict(num_samples=-1),
    ]
    for kw in bad:
        d = json.loads(encode(hello()))
        d.update(kw)
        with pytest.raises(MessageError):
            parse_message(json.dumps(d).encode(), Hello)
    d = json.loads(encode(hello()))
    d["surprise"] = 1                  # same major version: an unknown (newer minor) field is ignored, not kept
    assert parse_message(json.dumps(d).encode(), Hello) == hello()
    with pytest.raises(ValueError, match="Extra inputs"):  # built from Python, a typo is still an error
        Hello(**d)


@pytest.mark.parametrize("field, value", [
    ("round", "1"), ("round", 1.5), ("round", True), ("num_samples", "10"), ("train_loss", "1.0"),
    ("device_id", 5), ("layers", {"0": {}}),
])
def test_strict_types_on_the_wire(field, value):
    with pytest.raises(MessageError, match=f"invalid Stats: {field}"):
        parse_message(json.dumps(stats_dict(**{field: value})).encode(), Stats)
    assert parse_message(json.dumps(stats_dict(train_loss=1, train_seconds=2)).encode(), Stats).train_loss == 1.0


def test_nan_and_inconsistent_stats_rejected():
    raw = json.dumps(stats_dict()).replace('"train_loss": 1.0', '"train_loss": NaN').encode()
    with pytest.raises(MessageError):
        parse_message(raw, Stats)
    with pytest.raises(MessageError, match="entries"):
        parse_message(json.dumps(stats_dict(layers=[layer(margin=[0.1])])).encode(), Stats)
    with pytest.raises(MessageError):
        parse_message(json.dumps(stats_dict(update=dict(transfer_id="u", bytes=1, sha256="xyz", chunks=1))).encode(),
                      Stats)
    with pytest.raises(MessageError):
        parse_message(json.dumps(stats_dict(val_accuracy=1.5)).encode(), Stats)


def test_oversized_rejected_unparsed():
    with pytest.raises(MessageError, match="exceeds"):
        parse_message(b" " * (MAX_CONTROL_BYTES + 1))


def test_assignment_expert_ids_validated():
    from protocol.messages import ModelSpec, TrainConfig

    base = dict(round=1, model_version=0, model=ModelSpec(num_experts=4, top_k=2), task="bbc", labels=["a", "b"],
                shards=[], weight_format="int8", state=BlobRef(transfer_id="s", bytes=1, sha256=SHA, chunks=1),
                train=TrainConfig(), deadline=0.0)
    Assignment(experts={1: [0, 3]}, **base)
    for experts in ({1: [4]}, {1: []}, {1: [1, 1]}, {1: [-1]}):
        with pytest.raises(ValueError):
            Assignment(experts=experts, **base)
