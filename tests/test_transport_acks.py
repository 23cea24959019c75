"""Publish acknowledgements through paho's public API only (``Transport._acked``): every
state in which paho-mqtt 2.x ``MQTTMessageInfo.is_published()`` raises, and a QoS 1
publish queued while the broker is down, acknowledged after the reconnect."""

from __future__ import annotations

import threading
import time
import uuid

import paho.mqtt.client as mqtt
import pytest

from fedmoe.broker import MosquittoBroker
from protocol.transport import PublishError, Transport


def info(rc, mid=7):
    i = mqtt.MQTTMessageInfo(mid)
    i.rc = rc
    return i


def test_success_not_yet_published_is_not_acked():
    assert Transport("mqtt://127.0.0.1:1")._acked(info(mqtt.MQTT_ERR_SUCCESS)) is False


def test_queued_while_disconnected_is_acked_once_on_publish_saw_its_mid():
    t = Transport("mqtt://127.0.0.1:1")
    queued = info(mqtt.MQTT_ERR_NO_CONN)
    with pytest.raises(RuntimeError):
        queued.is_published()  # what paho itself does for this state
    assert t._acked(queued) is False
    t._on_publish(None, None, 8, None, None)  # another message's PUBACK
    assert t._acked(queued) is False
    t._on_publish(None, None, 7, None, None)
    assert t._acked(queued) is True


@pytest.mark.parametrize("rc,match", [(mqtt.MQTT_ERR_QUEUE_SIZE, "not queued"),
                                      (mqtt.MQTT_ERR_CONN_LOST, "will not be sent"),
                                      (mqtt.MQTT_ERR_PROTOCOL, "will not be sent")])
def test_messages_paho_will_never_send_raise_publish_error(rc, match):
    with pytest.raises(PublishError, match=match):
        Transport("mqtt://127.0.0.1:1")._acked(info(rc))


@pytest.mark.slow
@pytest.mark.skipif(not MosquittoBroker.available(), reason="no mosquitto binary")
def test_publish_queued_while_broker_down_completes_after_reconnect(tmp_path):
    broker = MosquittoBroker(str(tmp_path / "broker")).start()
    t = Transport(broker.url(), protocol="5").connect()
    infos = []
    publish = t._client.publish

    def spy(*a, **kw):
        infos.append(publish(*a, **kw))
        return infos[-1]

    t._client.publish = spy
    errors = []
    try:
        broker.stop()
        end = time.monotonic() + 20
        while t.connected and time.monotonic() < end:
            time.sleep(0.05)
        assert not t.connected
        topic = f"test/{uuid.uuid4().hex[:8]}/queued"

        def send():
            try:
                t.publish(topic, b"payload", timeout=60)
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        th = threading.Thread(target=send)
        th.start()
        time.sleep(1.0)
        assert th.is_alive()  # waiting for the acknowledgement, not failed
        assert [i.rc for i in infos] == [mqtt.MQTT_ERR_NO_CONN]  # the is_published-raises state
        broker.start()
        th.join(60)
        assert not th.is_alive() and errors == []
        assert t.reconnects >= 1
    finally:
        t.close()
        broker.stop()


def test_receive_maximum_leaves_a_backlog_in_the_broker_until_messages_are_acknowledged(mosquitto_url):
    """A consumer with manual acks and Receive Maximum 4 is handed at most 4 unacknowledged
    QoS 1 messages by a real Mosquitto; each ack lets the next one in, and nothing is lost."""
    sub = Transport(mosquitto_url, f"rm-sub-{uuid.uuid4().hex[:6]}", protocol="5", manual_ack=True,
                    receive_maximum=4).connect()
    assert sub.subscribe("rm/x", qos=1)
    pub = Transport(mosquitto_url, protocol="5").connect()
    for i in range(10):
        pub.publish("rm/x", str(i).encode(), qos=1)
    first = [sub.get(5) for _ in range(4)]
    assert all(m is not None for m in first)
    assert sub.get(1.0) is None                      # the other 6 wait in the broker
    got = [m.payload for m in first]
    for m in first:
        sub.ack(m)
    while len(got) < 10:
        m = sub.get(5)
        assert m is not None, got
        got.append(m.payload)
        sub.ack(m)
    assert got == [str(i).encode() for i in range(10)]
    with pytest.raises(ValueError, match="receive_maximum"):
        Transport(mosquitto_url, receive_maximum=0)
    pub.close()
    sub.close()


def test_a_full_inbox_stops_reading_without_blocking_own_publishes_and_loses_nothing(mosquitto_url):
    """inbox_max_bytes: with the inbox full, paho's network thread stops reading (the
    backlog stays in the broker), a publish of the consumer's own still gets its PUBACK,
    and once the consumer takes messages everything arrives in order."""
    sub = Transport(mosquitto_url, f"ib-sub-{uuid.uuid4().hex[:6]}", protocol="5", manual_ack=True,
                    inbox_max_bytes=3000).connect()
    assert sub.subscribe("ib/x", qos=1)
    pub = Transport(mosquitto_url, protocol="5").connect()
    for i in range(20):
        pub.publish("ib/x", b"%04d" % i + b"." * 996, qos=1)
    time.sleep(1.0)
    assert sub.inbox.qsize() <= 4 and sub.inbox_waits >= 1   # 3,000 bytes and the one let in after the wait
    t0 = time.monotonic()
    sub.publish("ib/own", b"x", qos=1)                      # its PUBACK is read meanwhile
    assert time.monotonic() - t0 < 2.0
    got = []
    while len(got) < 20:
        m = sub.get(10)
        assert m is not None, len(got)
        got.append(m.payload[:4])
        sub.ack(m)
    assert got == [b"%04d" % i for i in range(20)]
    pub.close()
    sub.close()
