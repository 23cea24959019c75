"""MQTT transport: a thin, safe wrapper around paho-mqtt 2.x used by both sides.

What it adds to paho (see docs/architecture.md "Known pitfalls"):

- MQTT 5 by default, falling back to 3.1.1 when the broker refuses v5 (the embedded
  amqtt broker speaks 3.1.1 only); ``protocol="5"`` or ``"3.1.1"`` forces one.
- User properties (signatures) travel as MQTT 5 properties or, over MQTT 3.1.1, in a
  payload envelope (:mod:`protocol.envelope`) that every receiver opens.
- Publish results are checked: a QoS 1 publish the broker refused (reason code in
  PUBACK) raises :class:`PublishError` instead of passing silently.
- The broker's Maximum Packet Size from CONNACK is honoured when chunking.
- Callbacks never block: received messages go to a bounded inbox queue that the
  owner drains with :meth:`Transport.get`.
- A retained message on a topic none of this client's subscriptions match is dropped
  (counted in :attr:`Transport.unsolicited`): amqtt 0.12.1 sends a connecting client the
  retained messages of *every* client's subscriptions (its ``handle_connection`` loops over
  the broker's whole subscription table). Dropping loses nothing: a broker sends the
  retained message again to whoever subscribes to a matching filter.
- Bytes on the wire are counted per PUBLISH packet in both directions
  (fixed header + topic + packet id + properties + payload), for traffic reports.
- Subscriptions are restored after an automatic reconnect, and a "birth" message
  (a device's retained ``online`` status) is republished on every (re)connect.
- QoS 1 publishes made while the connection is down are queued by paho and sent after
  the reconnect; :meth:`Transport.publish` waits (up to its timeout) rather than fail.
- With ``clean_start=False`` and ``session_expiry_s`` the broker keeps the session
  (subscriptions and queued QoS 1 messages) while the client is away (the aggregator
  uses this to receive updates published while it was down).
- A clustered broker is named by its nodes' URLs, comma-separated
  (``mqtt://10.0.0.1:1883,mqtt://10.0.0.2:1883``): each client starts at the node its
  client id hashes to (so a fleet spreads over the nodes without configuration) and,
  when that node is lost or refuses, reconnects to the next one; a cluster that keeps
  sessions and retained messages cluster-wide (NATS with JetStream,
  ``examples/deploy/nats/``) then carries on with nothing lost.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
import uuid
import zlib
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator
from urllib.parse import unquote, urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from . import envelope
from .chunking import DEFAULT_CHUNK_BYTES, split_blob
from .logsafe import LogLimiter, clip
from .messages import BlobRef

log = logging.getLogger(__name__)
SUBSCRIBE_RETRY_S = 2.0
"""Seconds before a subscription the broker refused (SUBACK failure) is asked for again."""
INBOX_WAIT_S = 5.0
"""Longest (seconds) paho's network thread holds one message back while the inbox is full
(``inbox_max_bytes``): well inside a 30 s keepalive, which it must keep answering."""


class TransportError(ConnectionError):
    """Connecting to the broker failed or was refused."""


class PublishError(RuntimeError):
    """The broker did not accept a publish (reason code, timeout, or queue full)."""


@dataclass(frozen=True)
class BrokerURL:
    """Parsed ``mqtt://[user[:password]@]host[:port]`` (``mqtts://`` = TLS, port 8883)."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> "BrokerURL":
        """Raises ValueError for another scheme or a missing host."""
        u = urlparse(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(f"unsupported broker URL scheme {u.scheme!r} (use mqtt:// or mqtts://)")
        if not u.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        tls = u.scheme in ("mqtts", "ssl")
        return cls(
            host=u.hostname,
            port=u.port or (8883 if tls else 1883),
            tls=tls,
            username=unquote(u.username) if u.username else None,
            password=unquote(u.password) if u.password else None,
        )

    @classmethod
    def parse_nodes(cls, urls: str) -> list["BrokerURL"]:
        """``urls``: one broker URL or the comma-separated URLs of a cluster's nodes.

        Raises:
            ValueError: an empty list, a URL :meth:`parse` refuses, or nodes that differ in
                TLS (one connection's settings serve every node).
        """
        nodes = [cls.parse(u.strip()) for u in str(urls).split(",") if u.strip()]
        if not nodes:
            raise ValueError("no broker URL given")
        if len({n.tls for n in nodes}) > 1:
            raise ValueError(f"broker nodes {urls!r} mix mqtt:// and mqtts://")
        return nodes


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings: CA bundle, optional client certificate and key (PEM paths)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class Incoming:
    """One received message."""

    topic: str
    payload: bytes
    retain: bool
    properties: dict[str, str]
    mid: int = 0
    qos: int = 0
    generation: int = 0
    """Which connection delivered it (acks of an earlier connection are not sent)."""


def _varint_len(n: int) -> int:
    size = 1
    while n >= 128:
        n //= 128
        size += 1
    return size


def publish_packet_bytes(topic: str, payload_len: int, qos: int, v5: bool, props_len: int = 0) -> int:
    """Size in bytes of an MQTT PUBLISH packet on the wire (without TLS framing)."""
    remaining = 2 + len(topic.encode()) + (2 if qos > 0 else 0) + payload_len
    if v5:
        remaining += _varint_len(props_len) + props_len
    return 1 + _varint_len(remaining) + remaining


class Transport:
    """One MQTT connection with a bounded inbox, checked publishes and byte counters.

    Args:
        url: broker URL (see :class:`BrokerURL`), or the comma-separated URLs of a
            cluster's nodes (:meth:`BrokerURL.parse_nodes`; the first node tried is the one
            ``client_id`` hashes to, then the others in order, also on every reconnect).
        client_id: MQTT client id (also the session key for persistent sessions).
        protocol: ``"auto"`` (v5, else 3.1.1), ``"5"`` or ``"3.1.1"``.
        username, password: override credentials from the URL.
        tls: TLS settings (implied by ``mqtts://``).
        will: (topic, payload) published retained by the broker if we vanish.
        clean_start: start a fresh session (False keeps subscriptions and queued
            QoS 1 messages across reconnects, with ``session_expiry_s``);
            ``"first_only"``: fresh on the first connect, resumed on reconnects (on MQTT
            3.1.1 only for a cluster: a single 3.1.1 broker gets a clean session each time).
        max_payload: largest payload we publish, in bytes (chunks are cut below it);
            lowered to the broker's Maximum Packet Size when CONNACK announces one.
        inbox_max: bound on queued received messages (excess is dropped and logged).
        manual_ack: acknowledge a received QoS 1 message only when the owner calls
            :meth:`ack` (after handling and persisting it), so a crash before that makes
            the broker redeliver it to the persistent session instead of losing it.
        receive_maximum: MQTT 5: at most this many received QoS 1 messages unacknowledged
            at once (the CONNECT's Receive Maximum; None: the protocol's 65,535). A consumer
            slower than its senders then leaves the backlog in the broker instead of its
            inbox: unbounded, a 1,000-device round of 1 MiB updates queued 1 GiB in the
            aggregator's. MQTT 3.1.1 has no such property (the broker's own limit applies,
            e.g. Mosquitto's ``max_inflight_messages``).
        inbox_max_bytes: flow control on this side: while the inbox holds this many payload
            bytes, paho's network thread waits (up to :data:`INBOX_WAIT_S` per message, so
            keepalives still go out) before queueing the next message, and the socket it
            does not read leaves the backlog in the broker. Not while this client waits for
            its own publishes to be acknowledged (that needs the network thread). Needed
            because Mosquitto 2.0.11 stops holding a client to its Receive Maximum once the
            client acknowledges (measured: 6,516 chunks, 1.6 GiB, queued in the aggregator's
            inbox with Receive Maximum 256). None: unbounded.
    """

    def __init__(
        self,
        url: str,
        client_id: str | None = None,
        *,
        protocol: str = "auto",
        username: str | None = None,
        password: str | None = None,
        tls: TlsConfig | None = None,
        will: tuple[str, bytes] | None = None,
        clean_start: bool | str = True,
        session_expiry_s: int = 0,
        max_payload: int = DEFAULT_CHUNK_BYTES,
        keepalive_s: int = 30,
        inbox_max: int = 200_000,
        max_inflight: int = 32,
        manual_ack: bool = False,
        receive_maximum: int | None = None,
        inbox_max_bytes: int | None = None,
    ):
        if protocol not in ("auto", "5", "3.1.1"):
            raise ValueError(f"protocol must be auto, 5 or 3.1.1, not {protocol!r}")
        self.nodes = BrokerURL.parse_nodes(url)
        self.client_id = client_id or f"fedmoe-{uuid.uuid4().hex[:12]}"
        self._node = zlib.crc32(self.client_id.encode()) % len(self.nodes)
        self.url = self.nodes[self._node]
        self.protocol = protocol
        self.username = username or self.url.username
        self.password = password or self.url.password
        self.tls = tls if tls is not None else (TlsConfig() if self.url.tls else None)
        self.will = will
        self.clean_start = clean_start
        self.session_expiry_s = session_expiry_s
        self.max_payload = int(max_payload)
        self.keepalive_s = keepalive_s
        self.max_inflight = max_inflight
        self.inbox: queue.Queue[Incoming] = queue.Queue(maxsize=inbox_max)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dropped = 0
        self.unsolicited = 0
        """Retained messages dropped because no subscription of this client matches them."""
        self.v5 = protocol != "3.1.1"
        self.broker_max_packet: int | None = None
        self._subs: dict[str, int] = {}
        self._client: mqtt.Client | None = None
        self._connected = threading.Event()
        self._suback = threading.Condition()
        self._subacked: set[int] = set()
        self._sub_pending: dict[int, str] = {}
        self._sub_failed: set[str] = set()
        self._sub_done: set[str] = set()
        """Topics the broker acknowledged in the current session."""
        self._no_retry: set[str] = set()
        """Topics subscribed with ``retry=False``: dropped, not asked for again, when refused."""
        self._sub_log = LogLimiter(log, "refused subscriptions", per_key=3, total=50)
        self._connack: object = None
        self._results: dict[int, object] = {}
        self._nowait: set[int] = set()
        self.nowait_failed = 0
        """Fire-and-forget publishes (:meth:`publish_nowait`) that failed or the broker refused."""
        self._drop_log = LogLimiter(log, "inbox-full drops", per_key=1, total=1, summary_level=logging.ERROR)
        self._lock = threading.Lock()
        self._closing = False
        self.birth: tuple[str, bytes] | None = None
        """(topic, payload) published retained, QoS 1, on every (re)connect."""
        self.session_present = False
        self.reconnects = 0
        self._ever_connected = False
        self.manual_ack = manual_ack
        if receive_maximum is not None and not 1 <= receive_maximum <= 65535:
            raise ValueError(f"receive_maximum must be within 1..65535, not {receive_maximum}")
        self.receive_maximum = receive_maximum
        self.inbox_max_bytes = inbox_max_bytes
        self._inbox_bytes = 0
        self._room = threading.Condition()
        """Guards ``_inbox_bytes`` and ``_awaiting``; notified when either drops."""
        self._awaiting = 0
        """Calls of this client waiting for the broker's answer (:meth:`_awaiting_broker`)."""
        self.inbox_waits = 0
        """Messages that arrived with the inbox full (paho's network thread held them back unless this
        client was waiting for the broker)."""
        self._generation = 0
        self._connect_kwargs: dict = {}

    # ------------------------------------------------------------------ connection
    def connect(self, timeout: float = 30.0) -> "Transport":
        """Connect (and start the network thread).

        Raises:
            TransportError: refused (bad credentials, protocol) or no CONNACK in ``timeout`` s.
        """
        for attempt in range(len(self.nodes)):
            try:
                return self._connect_node(timeout)
            except TransportError as e:
                if attempt == len(self.nodes) - 1 or "cannot reach" not in str(e):
                    raise
                log.warning("%s; trying the next broker node", e)
                self._next_node()
        raise AssertionError("unreachable")

    def _next_node(self) -> BrokerURL:
        """Move to the next broker node (round robin); returns it."""
        self._node = (self._node + 1) % len(self.nodes)
        self.url = self.nodes[self._node]
        return self.url

    def _connect_node(self, timeout: float) -> "Transport":
        versions = {"auto": [True, False], "5": [True], "3.1.1": [False]}[self.protocol]
        last: object = None
        for v5 in versions:
            self.v5 = v5
            probing = v5 and len(versions) > 1
            try:
                # Some 3.1.1-only brokers (amqtt) drop a v5 CONNECT without any CONNACK.
                rc = self._connect_once(v5, min(timeout, 5.0) if probing else timeout)
            except TransportError as e:
                if not probing or "no CONNACK" not in str(e):
                    raise
                rc = "no CONNACK to MQTT 5 CONNECT (protocol not supported?)"
            if rc is None and not v5 and self.clean_start == "first_only" and len(self.nodes) > 1:
                # MQTT 3.1.1 fixes clean-session per connection: the fresh start is done, now take a
                # session the cluster keeps, so moving to another node loses nothing. A single 3.1.1
                # broker keeps clean sessions: 3.1.1 has no session expiry, and the embedded amqtt broker
                # stalls broadcasting to an abandoned session's queue
                self._closing = True  # a disconnect of our own: no failover to another node
                self._client.disconnect()
                self._client.loop_stop()
                self._closing = False
                rc = self._connect_once(v5, timeout, clean=False)
            if rc is None:
                log.info("connected to %s:%d as %s (MQTT %s)", self.url.host, self.url.port, self.client_id,
                         "5" if v5 else "3.1.1")
                return self
            last = rc
            if not probing or "protocol" not in str(rc).lower():
                break
            log.info("broker refused MQTT 5 (%s); retrying with 3.1.1", rc)
        raise TransportError(f"broker {self.url.host}:{self.url.port} refused the connection: {last}")

    def _connect_once(self, v5: bool, timeout: float, clean: bool | None = None) -> object | None:
        if self._client is not None:
            self._client.loop_stop()
        self._connected.clear()
        self._connack = None
        c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else bool(self.clean_start) if clean is None else clean,
        )
        c.max_inflight_messages_set(self.max_inflight)
        if self.manual_ack:
            c.manual_ack_set(True)
        c.max_queued_messages_set(65536)
        c.reconnect_delay_set(1, 10)
        if self.username:
            c.username_pw_set(self.username, self.password)
        if self.tls is not None:
            c.tls_set(
                ca_certs=self.tls.ca_certs, certfile=self.tls.certfile, keyfile=self.tls.keyfile,
                cert_reqs=ssl.CERT_NONE if self.tls.insecure else ssl.CERT_REQUIRED,
            )
            c.tls_insecure_set(self.tls.insecure)
        if self.will is not None:
            c.will_set(self.will[0], self.will[1], qos=1, retain=True)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_subscribe = self._on_subscribe
        c.on_connect_fail = self._on_connect_fail
        self._client = c
        kwargs = {}
        if v5:
            props = Properties(PacketTypes.CONNECT)
            if self.session_expiry_s:
                props.SessionExpiryInterval = int(self.session_expiry_s)
            if self.receive_maximum is not None:
                props.ReceiveMaximum = self.receive_maximum
            cs = mqtt.MQTT_CLEAN_START_FIRST_ONLY if self.clean_start == "first_only" else bool(self.clean_start)
            kwargs = {"clean_start": cs, "properties": props}
        self._connect_kwargs = kwargs
        try:
            c.connect(self.url.host, self.url.port, keepalive=self.keepalive_s, **kwargs)
        except OSError as e:
            raise TransportError(f"cannot reach broker {self.url.host}:{self.url.port}: {e}") from None
        c.loop_start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._connected.is_set():
                return None
            if self._connack is not None:
                c.loop_stop()
                c.disconnect()
                return self._connack
            time.sleep(0.01)
        c.loop_stop()
        raise TransportError(f"no CONNACK from {self.url.host}:{self.url.port} within {timeout} s")

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._connack = reason_code
            return
        if properties is not None and hasattr(properties, "MaximumPacketSize"):
            self.broker_max_packet = int(properties.MaximumPacketSize)
        self.session_present = bool(getattr(flags, "session_present", False))
        self._generation += 1
        if not self.session_present:
            self._sub_done.clear()
        for topic, qos in list(self._subs.items()):
            # a resumed session keeps its subscriptions: subscribing again would make a broker that
            # backs a subscription with a durable consumer (NATS) replace it and drop what it queued
            if topic not in self._sub_done:
                self._send_subscribe(client, topic, qos)
        if self.birth is not None:
            client.publish(self.birth[0], self.birth[1], qos=1, retain=True)
        if self._ever_connected:
            self.reconnects += 1
            log.info("reconnected to %s:%d as %s (session present: %s)", self.url.host, self.url.port,
                     self.client_id, self.session_present)
        self._ever_connected = True
        self._connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self._connected.is_set() and not self._closing:
            log.warning("disconnected from broker %s:%d (%s); paho will reconnect", self.url.host, self.url.port,
                        reason_code)
        self._connected.clear()
        if not self._closing:
            self._failover(client)

    def _on_connect_fail(self, client, userdata) -> None:
        self._failover(client)

    def _failover(self, client) -> None:
        """Point paho's next automatic reconnect at the next broker node (clusters only)."""
        if len(self.nodes) < 2:
            return
        node = self._next_node()
        # paho's own reconnect (its network loop, right after this callback) then dials the new node,
        # keeping the session's queued and in-flight QoS 1 messages
        client.connect_async(node.host, node.port, keepalive=self.keepalive_s, **self._connect_kwargs)
        log.info("%s: reconnecting to broker node %s:%d", self.client_id, node.host, node.port)

    def _subscribed_to(self, topic: str) -> bool:
        """Whether a subscription of this client (a shared one by its filter) matches ``topic``."""
        for sub in list(self._subs):
            if sub.startswith("$share/") and sub.count("/") >= 2:
                sub = sub.split("/", 2)[2]
            if mqtt.topic_matches_sub(sub, topic):
                return True
        return False

    def _on_message(self, client, userdata, msg) -> None:
        if msg.retain and not self._subscribed_to(msg.topic):  # amqtt's stray retained message (module docstring)
            self.unsolicited += 1
            log.debug("dropped a retained message on %s: no subscription matches it", clip(msg.topic))
            if self.manual_ack and msg.qos > 0:
                client.ack(msg.mid, msg.qos)
            return
        props = {}
        if msg.properties is not None and hasattr(msg.properties, "UserProperty"):
            props = dict(msg.properties.UserProperty)
        self.bytes_received += publish_packet_bytes(msg.topic, len(msg.payload), msg.qos, self.v5)
        payload = bytes(msg.payload)
        if payload.startswith(envelope.MAGIC) and (opened := envelope.unwrap(payload)) is not None:
            payload, props = opened[0], {**opened[1], **props}  # sent over MQTT 3.1.1 (protocol.envelope)
        if self.inbox_max_bytes is not None:
            self._wait_for_room(len(payload))
        try:
            self.inbox.put_nowait(Incoming(msg.topic, payload, bool(msg.retain), props, msg.mid, msg.qos,
                                           self._generation))
        except queue.Full:
            self._took(len(payload))
            self.dropped += 1
            self._drop_log.log("inbox full", logging.ERROR, "inbox full: dropped a message on %s", clip(msg.topic))

    def _wait_for_room(self, size: int) -> None:
        """Hold paho's network thread while the inbox is over ``inbox_max_bytes`` (at most
        :data:`INBOX_WAIT_S`, and not while this client waits for its own PUBACKs), then
        count ``size`` bytes in."""
        with self._room:
            deadline = time.monotonic() + INBOX_WAIT_S
            if self._inbox_bytes >= self.inbox_max_bytes:
                self.inbox_waits += 1
            while self._inbox_bytes >= self.inbox_max_bytes and not self._awaiting and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._room.wait(min(left, 0.1))
            self._inbox_bytes += size

    def _took(self, size: int) -> None:
        if self.inbox_max_bytes is not None:
            with self._room:
                self._inbox_bytes -= size
                self._room.notify_all()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self._lock:
            if mid in self._nowait:  # nobody waits for it: only count a refusal
                self._nowait.discard(mid)
                self.nowait_failed += bool(getattr(reason_code, "is_failure", False))
            else:
                self._results[mid] = reason_code

    @property
    def connected(self) -> bool:
        """Whether the MQTT session is up now (CONNACK received, not yet lost)."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        """Block until (re)connected; False on timeout."""
        return self._connected.wait(timeout)

    def close(self, end_session: bool = False) -> None:
        """Disconnect cleanly (no Last Will is sent) and stop the network thread.

        Args:
            end_session: also tell the broker to drop a persistent session (MQTT 5).
        """
        if self._client is not None:
            self._closing = True
            try:
                props = None
                if end_session and self.v5 and self.session_expiry_s:
                    props = Properties(PacketTypes.DISCONNECT)
                    props.SessionExpiryInterval = 0
                self._client.disconnect(properties=props)
            finally:
                self._client.loop_stop()
            self._client = None
            self._connected.clear()

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, topic: str, qos: int = 1, timeout: float | None = None, retry: bool = True) -> bool:
        """Subscribe now (if connected) and again on every reconnect.

        Args:
            topic: topic filter.
            qos: maximum QoS.
            timeout: wait up to this many seconds for the broker's SUBACK (None: don't).
            retry: ask again every :data:`SUBSCRIBE_RETRY_S` s while the broker refuses the
                subscription (logged, rate-limited), as a broker cluster may refuse while it
                moves a session. False: a refusal (an ACL's) drops the subscription quietly
                (debug log); the caller learns it from the return value.

        Returns:
            True once acknowledged (or not waited for); False if ``timeout`` passed first,
            the broker refused it, or the client is not connected (it subscribes when it
            connects).
        """
        self._subs[topic] = qos
        (self._no_retry.discard if retry else self._no_retry.add)(topic)
        if self._client is None or not self.connected:
            return timeout is None
        mid = self._send_subscribe(self._client, topic, qos)
        if timeout is None:
            return True
        with self._awaiting_broker(), self._suback:
            ok = self._suback.wait_for(lambda: mid in self._subacked, timeout)
            self._subacked.discard(mid)
        return ok and topic not in self._sub_failed

    def _send_subscribe(self, client, topic: str, qos: int) -> int:
        _, mid = client.subscribe(topic, qos=qos)
        with self._suback:
            self._sub_pending[mid] = topic
            if len(self._sub_pending) > 4096:  # SUBACKs that never came (a lost connection)
                self._sub_pending = {mid: topic}
        return mid

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        failed = any(getattr(rc, "is_failure", False) for rc in reason_codes or ())
        with self._suback:
            topic = self._sub_pending.pop(mid, None)
            if topic is not None:
                (self._sub_failed.add if failed else self._sub_failed.discard)(topic)
                (self._sub_done.discard if failed else self._sub_done.add)(topic)
            self._subacked.add(mid)
            if len(self._subacked) > 4096:  # acks nobody waits for
                self._subacked.clear()
                self._subacked.add(mid)
            self._suback.notify_all()
        if failed and topic is not None and topic in self._no_retry:
            self._subs.pop(topic, None)
            log.debug("broker refused the subscription to %s (not asked for again)", clip(topic))
        elif failed and topic is not None and topic in self._subs:
            # a clustered broker refuses while it moves a session to another node (NATS: the
            # durable consumer behind the subscription is not placed yet): ask again shortly
            self._sub_log.log(topic, logging.WARNING, "broker refused the subscription to %s; retrying in %.0f s",
                              clip(topic), SUBSCRIBE_RETRY_S)
            timer = threading.Timer(SUBSCRIBE_RETRY_S, self._resubscribe, (topic,))
            timer.daemon = True
            timer.start()

    def _resubscribe(self, topic: str) -> None:
        client = self._client
        if client is not None and not self._closing and topic in self._subs and self.connected:
            self._send_subscribe(client, topic, self._subs[topic])

    def unsubscribe(self, topic: str) -> None:
        """Stop receiving ``topic`` (and no longer resubscribe it after a reconnect)."""
        self._subs.pop(topic, None)
        self._sub_done.discard(topic)
        self._no_retry.discard(topic)
        if self._client is not None and self.connected:
            self._client.unsubscribe(topic)

    def ack(self, msg: Incoming) -> None:
        """Acknowledge ``msg`` to the broker (``manual_ack`` only; no-op otherwise, for QoS 0,
        or for a message of an earlier connection, which the broker redelivers)."""
        if self.manual_ack and msg.qos > 0 and self._client is not None and msg.generation == self._generation:
            self._client.ack(msg.mid, msg.qos)

    def get(self, timeout: float | None = None) -> Incoming | None:
        """Next received message, or None after ``timeout`` seconds."""
        try:
            m = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        self._took(len(m.payload))
        return m

    # ------------------------------------------------------------------ publishing
    @property
    def chunk_payload_bytes(self) -> int:
        """Largest payload per chunk message: configured size, capped by the broker's limit."""
        limit = self.max_payload
        if self.broker_max_packet:
            limit = min(limit, self.broker_max_packet - 1024)
        return limit

    def _props(self, user_properties: dict[str, str] | None) -> tuple[Properties | None, int]:
        if not (self.v5 and user_properties):
            return None, 0
        p = Properties(PacketTypes.PUBLISH)
        p.UserProperty = list(user_properties.items())
        return p, len(p.pack()) - _varint_len(len(p.pack()))

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 60.0,
        user_properties: dict[str, str] | None = None,
    ) -> None:
        """Publish one message and wait until the broker acknowledged it (QoS 1).

        Raises:
            PublishError: not connected and never reconnected, queue full, timeout,
                or a failure reason code from the broker.
        """
        self.publish_many([(topic, payload, retain)], qos=qos, timeout=timeout, user_properties=user_properties)

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 1) -> bool:
        """Fire and forget: hand one message to paho and return at once, without waiting
        for the broker's PUBACK (for best-effort replies, such as rejections, that must not
        hold up the caller for a round trip). Never raises: a failure or a refusal by the
        broker is counted in :attr:`nowait_failed`.

        Returns:
            Whether paho accepted the message (sent, or queued while disconnected).
        """
        info = None
        if self._client is not None:
            try:
                info = self._client.publish(topic, payload, qos=qos)
            except (ValueError, OSError) as e:
                log.debug("publish_nowait to %s failed: %s", clip(topic), e)
        if info is None or info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            with self._lock:  # paho's callback thread counts refusals under the same lock
                self.nowait_failed += 1
            return False
        self.bytes_sent += publish_packet_bytes(topic, len(payload), qos, self.v5)
        with self._lock:  # on_publish may already have run (then its result is here)
            if self._results.pop(info.mid, None) is None:
                if len(self._nowait) > 4096:  # mids of a lost connection, never acknowledged
                    self._nowait.clear()
                self._nowait.add(info.mid)
        return True

    def publish_many(
        self,
        items: list[tuple[str, bytes, bool]],
        qos: int = 1,
        timeout: float = 120.0,
        user_properties: dict[str, str] | None = None,
    ) -> None:
        """Publish (topic, payload, retain) items with a window of outstanding QoS 1 acks.

        Raises:
            PublishError: as :meth:`publish`, for the first item that failed.
        """
        if self._client is None:
            raise PublishError("transport is not connected")
        with self._awaiting_broker():
            self._publish_window(items, qos, time.monotonic() + timeout, user_properties)

    @contextmanager
    def _awaiting_broker(self) -> Iterator[None]:
        """While this client waits for the broker's answer (a PUBACK, a SUBACK), paho's
        network thread, which reads it, must not wait for room in the inbox."""
        with self._room:
            self._awaiting += 1
            self._room.notify_all()
        try:
            yield
        finally:
            with self._room:
                self._awaiting -= 1

    def _publish_window(self, items: list[tuple[str, bytes, bool]], qos: int, deadline: float,
                        user_properties: dict[str, str] | None) -> None:
        props, props_len = self._props(user_properties)
        wrapped = bool(user_properties) and not self.v5  # MQTT 3.1.1: the properties travel in an envelope
        window: deque = deque()
        for topic, payload, retain in items:
            if wrapped:
                payload = envelope.wrap(payload, user_properties)
            while len(window) >= self.max_inflight:
                self._finish(window.popleft(), deadline)
            info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise PublishError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
            self.bytes_sent += publish_packet_bytes(topic, len(payload), qos, self.v5, props_len)
            window.append((topic, info))
        while window:
            self._finish(window.popleft(), deadline)

    def _finish(self, item, deadline: float) -> None:
        topic, info = item
        while not self._acked(info):
            if time.monotonic() > deadline:
                raise PublishError(f"publish to {topic} not acknowledged in time")
            if info.rc == mqtt.MQTT_ERR_NO_CONN:
                time.sleep(0.05)  # queued while disconnected: paho sends it after the reconnect
            else:
                info.wait_for_publish(timeout=0.5)
        with self._lock:
            rc = self._results.pop(info.mid, None)
        if rc is not None and getattr(rc, "is_failure", False):
            raise PublishError(f"broker rejected publish to {topic}: {rc}")

    def _acked(self, info: mqtt.MQTTMessageInfo) -> bool:
        """Whether the broker acknowledged the message, through paho's public API only.

        paho-mqtt 2.x ``MQTTMessageInfo.is_published()`` raises ``RuntimeError`` for any
        ``info.rc > 0``, including ``MQTT_ERR_NO_CONN``: a QoS 1 message queued while the
        connection was down, which paho still sends after the reconnect (and whose ``rc``
        it never resets). For that one the acknowledgement is this transport's own
        ``on_publish`` record of ``info.mid`` (the callback paho calls on PUBACK).

        Raises:
            PublishError: paho will never send the message: ``is_published`` raised
                ``ValueError`` (``MQTT_ERR_QUEUE_SIZE``, its outgoing queue was full) or
                ``RuntimeError`` for an ``rc`` other than ``MQTT_ERR_NO_CONN`` (e.g. a QoS 0
                message lost with the connection).
        """
        try:
            return info.is_published()
        except ValueError as e:
            raise PublishError(f"message {info.mid} was not queued: {e}") from e
        except RuntimeError as e:
            if info.rc != mqtt.MQTT_ERR_NO_CONN:
                raise PublishError(f"message {info.mid} will not be sent: {e}") from e
        with self._lock:  # queued while disconnected: acknowledged once on_publish saw its mid
            return info.mid in self._results

    def publish_blob(
        self,
        topic: str | Callable[[int], str],
        data: bytes,
        kind: str,
        round: int,
        transfer_id: str | None = None,
        retain: bool = False,
        user_properties: dict[str, str] | None = None,
    ) -> BlobRef:
        """Chunk ``data`` under the packet limit and publish every chunk (QoS 1).

        Args:
            topic: one topic for all chunks, or ``seq -> topic`` (retained shards use
                one topic per chunk).

        Returns:
            The :class:`BlobRef` a control message uses to reference the blob.
        """
        transfer_id = transfer_id or uuid.uuid4().hex[:16]
        chunks, sha = split_blob(data, self.chunk_payload_bytes, transfer_id, kind, round)
        items = [(topic(i) if callable(topic) else topic, c, retain) for i, c in enumerate(chunks)]
        self.publish_many(items, user_properties=user_properties)
        return BlobRef(transfer_id=transfer_id, bytes=len(data), sha256=sha, chunks=len(chunks))
