"""MQTT 3.1.1's envelope for user properties (protocol.envelope, PROTOCOL.md §8.1)."""

from __future__ import annotations

import struct
import uuid

import pytest

from protocol import envelope
from protocol.transport import Transport


def test_wrap_and_unwrap_round_trip_and_bounds():
    props = {"fedmoe-sig": "abc", "fedmoe-key": "ünï"}
    data = envelope.wrap(b"FMC1payload", props)
    assert envelope.unwrap(data) == (b"FMC1payload", props)
    with pytest.raises(ValueError, match="more than"):
        envelope.wrap(b"", {"k": "x" * envelope.MAX_HEADER_BYTES})
    with pytest.raises(ValueError, match="strings"):
        envelope.wrap(b"", {"k": 1})


@pytest.mark.parametrize("bad", [
    b"FMP1", b"FMP1\x00\x10{}", envelope.MAGIC + struct.pack(">H", 5000) + b"{}" * 2600,
    envelope.MAGIC + struct.pack(">H", 2) + b"[]", envelope.MAGIC + struct.pack(">H", 8) + b'{"a": 1}',
    envelope.MAGIC + struct.pack(">H", 2) + b"\xff\xfe", b'{"v": 1}', b"FMC1....",
])
def test_malformed_envelopes_are_not_opened(bad):
    assert envelope.unwrap(bad) is None


@pytest.mark.parametrize("sender,receiver", [("3.1.1", "5"), ("3.1.1", "3.1.1"), ("5", "3.1.1")])
def test_properties_reach_a_receiver_of_either_version(mosquitto_url, sender, receiver):
    topic = f"t/{uuid.uuid4().hex[:8]}/x"
    rx = Transport(mosquitto_url, f"rx-{uuid.uuid4().hex[:6]}", protocol=receiver).connect()
    tx = Transport(mosquitto_url, f"tx-{uuid.uuid4().hex[:6]}", protocol=sender).connect()
    try:
        assert rx.subscribe(topic, qos=1, timeout=10)
        tx.publish(topic, b"FMC1body", user_properties={"sig": "s1", "key": "k"})
        m = rx.get(10)
        assert m is not None and m.payload == b"FMC1body"
        if sender == "3.1.1" or receiver == "5":
            assert m.properties == {"sig": "s1", "key": "k"}
        else:  # MQTT 5 properties cannot reach a 3.1.1 subscriber: the broker drops them
            assert m.properties == {}
    finally:
        rx.close()
        tx.close()
