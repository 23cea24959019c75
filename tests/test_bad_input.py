"""Bad input over a real broker: rejected with a reply, never reaching the model."""

import math

import pytest
import torch

from protocol.chunking import split_blob
from protocol.codec import encode_tensors
from protocol.messages import Hello, encode
from protocol.topics import Topics
from protocol.transport import Transport
from tests.federation import Federation, drain_downlink


def rogue(fed: Federation, replies: list, assignments: list):
    t = Topics(fed.federation)
    tr = Transport(fed.url, "rogue-evil", protocol=fed.protocol).connect()
    tr.subscribe(t.device_down("evil"), timeout=10)

    def drain(seconds):
        drain_downlink(tr, seconds, replies, assignments)

    up = lambda kind: t.up("evil", kind)  # noqa: E731
    tr.publish(up("stats"), b'{"v":1,"type":"stats"}')                       # unknown device
    hello = Hello(device_id="evil", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"], num_samples=50,
                  task="bbc", runtime_bytes=0)
    tr.publish(up("hello"), encode(hello.model_copy(update={"device_id": "other"})))  # id differs from topic
    tr.publish(up("hello"), encode(hello))
    drain(1.0)
    tr.publish(up("stats"), b"{not json")                                      # malformed
    tr.publish(up("update"), b"garbage chunk")                                 # not a chunk
    for _ in range(100):
        if assignments:
            break
        drain(0.2)
    a = assignments[0]
    good = {k: torch.zeros(s) for k, (s, _) in fed.aggregator.model.expected_for(a.experts, "bbc").items()}

    def send(tensors, rnd, tid):
        chunks, _ = split_blob(encode_tensors(tensors), 4096, tid, "update", rnd)
        tr.publish_many([(up("update"), c, False) for c in chunks])

    send(good, a.round - 1, "stale")                                           # stale round
    wrong = dict(good)
    k0 = next(iter(wrong))
    wrong[k0] = torch.zeros(3, 3)
    send(wrong, a.round, "shape")                                              # wrong shape
    nan = {k: v.clone() for k, v in good.items()}
    nan[k0].view(-1)[0] = math.nan
    send(nan, a.round, "nan")                                                  # NaN
    extra = dict(good)
    extra["expert.1.99.fc1.lora_B"] = torch.zeros(2, 2)
    send(extra, a.round, "unassigned")                                         # an expert it does not hold
    drain(3.0)
    tr.close()


@pytest.mark.slow
def test_bad_input_rejected_and_round_survives(mosquitto_url, tmp_path):
    replies, assignments = [], []
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2,), min_devices=2, round_timeout_s=15)
    (rec,) = fed.run(extra=lambda f: rogue(f, replies, assignments))
    text = "\n".join(replies)
    for expected in ("unknown device", "does not match the topic", "not valid JSON", "bad magic",
                     "current round is", "shape", "NaN or Inf", "unexpected"):
        assert expected in text, (expected, text)
    assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0"}
    assert "evil" in rec["failures"]
    assert all(torch.isfinite(v).all() for v in fed.aggregator.model.state.values())
