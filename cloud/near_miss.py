"""Answering a device whose federation name is a near miss of this aggregator's.

A device started with a mistyped federation name (``bbc-dmeo`` for ``bbc-demo``) publishes
its hello under ``fl/v1/bbc-dmeo/``, where no aggregator listens: without this it waits
its ``hello_timeout_s`` (60 s) and leaves saying that no aggregator answered. The
aggregator (``near_miss_hellos``, on by default; not a worker) therefore also takes the
hellos of every federation on the broker, on a second, clean MQTT session at QoS 0
(``fl/v1/+/dev/+/up/hello``: on its own session the filter would overlap the aggregator's
own and an MQTT 5 broker would deliver its hellos twice), and answers a device of a
federation whose name is a near miss of its own
(:func:`protocol.plugins.close_matches`, the closeness of every "did you mean") with a
``reject`` of kind ``hello`` on that device's ``down/command`` in *that* federation::

    hello rejected: unknown federation 'bbc-dmeo' on this broker; did you mean 'bbc-demo'?

A near-miss name may also be a federation of its own (``site-a`` next to ``site-b``), so
only a hello nobody answers is answered: one whose device sent it again at least
:data:`GRACE_S` seconds after this aggregator first saw it (a device sends an unanswered
hello again after 5, 10, 20 ... s; one its aggregator registered does not), of a
federation whose aggregator has published no progress in the last :data:`SERVED_S`
seconds. Other names (not near misses, or this federation's own) are ignored silently.

Everything is bounded: empty payloads (cleared retained hellos), payloads over
:data:`MAX_HELLO_BYTES`, invalid hellos and hellos whose device id is not the topic's
are ignored; at most :data:`MAX_NEW_DEVICES_PER_MIN` new (federation, device) pairs are
tracked a minute (the rest are ignored until the next minute), each forgotten after
:data:`FORGET_S` s; a device is answered at most once per :data:`GRACE_S` s; answers are
logged rate-limited. A broker that refuses the wildcard subscriptions (an ACL that
confines the aggregator to its own federation) turns this off: logged once at INFO.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

from protocol.logsafe import LogLimiter, clip
from protocol.messages import Command, Hello, MessageError, encode, parse_message
from protocol.plugins import close_matches
from protocol.topics import ROOT, Topics, check_id
from protocol.transport import Transport, TransportError

log = logging.getLogger(__name__)

HELLO_FILTER = f"{ROOT}/+/dev/+/up/hello"
"""The hellos of every federation on the broker."""
PROGRESS_FILTER = f"{ROOT}/+/cloud/progress"
"""The progress events of every federation's aggregator: a federation that has one is left alone."""
GRACE_S = 10.0
"""A near-miss hello is answered once its device sent it again at least this many seconds
after this aggregator first saw it (the device's resends come 5, 15, 35 s after it joined:
it is answered about 15 s after it joined), and then at most once per this many seconds."""
SERVED_S = 600.0
"""A federation whose aggregator published progress within this many seconds is not a typo."""
MAX_NEW_DEVICES_PER_MIN = 100
"""New (federation, device) pairs tracked per minute; the hellos of further ones are ignored."""
FORGET_S = 300.0
"""Seconds after which a tracked device is forgotten (its next hello counts as a first one)."""
MAX_HELLO_BYTES = 16 * 1024
"""Larger payloads on a hello topic of another federation are ignored unparsed."""
MAX_SERVED = 1000
"""Federations with an aggregator remembered (least recently seen forgotten first)."""
POLL_MAX = 1000
"""Messages :meth:`NearMissHellos.poll` handles per call (the rest wait in the inbox)."""


def near_miss_reason(federation: str, own: str) -> str:
    """The ``reason`` of the reject a device of ``federation`` gets from the aggregator of
    ``own``: ``hello rejected: unknown federation 'bbc-dmeo' on this broker; did you mean
    'bbc-demo'?`` (the device looks for ``unknown federation '<its federation>'``)."""
    return f"hello rejected: unknown federation {federation!r} on this broker; did you mean {own!r}?"


class NearMissHellos:
    """The near-miss watch of one aggregator (module docstring).

    Args:
        federation: the aggregator's federation.
        transport: an unconnected :class:`protocol.transport.Transport` of its own (a clean
            session; the aggregator's broker, account and TLS), or None to only use
            :meth:`handle` (tests).
        on_count: called with ``"answered"`` (a reject sent), ``"pending"`` (a first
            hello of a near-miss federation's device, waiting for it to come again) or
            ``"ignored"`` (a near-miss hello dropped: junk, or over the bound), e.g. the
            Prometheus counter ``fedmoe_foreign_hellos_total``.
        clock: monotonic time source, seconds (tests).

    Raises:
        ValueError: ``federation`` is not a valid topic level.
    """

    def __init__(self, federation: str, transport: Transport | None, *,
                 on_count: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.federation = check_id(federation, "federation")
        self.transport = transport
        self.on_count = on_count
        self.clock = clock
        self.active = False
        """Whether the watch is subscribed (:meth:`start` succeeded)."""
        self.answered = 0
        """Rejects sent to devices of near-miss federations."""
        self.ignored = 0
        """Hellos of near-miss federations dropped (junk, or over the bound)."""
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        """(federation, device) -> when its hello was first seen, or last answered; oldest first."""
        self._served: OrderedDict[str, float] = OrderedDict()
        """federation -> when its aggregator's progress was last seen; oldest first."""
        self._near: dict[str, bool] = {}
        """federation name -> whether it is a near miss (a cache, cleared at 4096 names)."""
        self._minute, self._new = clock(), 0
        self._log = LogLimiter(log, "near-miss hello answers", per_key=3, total=10, interval_s=60.0,
                               summary_level=logging.INFO)

    # ------------------------------------------------------------------ the connection
    def start(self, timeout: float = 10.0) -> bool:
        """Connect and subscribe to the hellos and progress events of every federation.
        Never raises: a connection that fails or a subscription the broker refuses (an
        ACL) is logged once at INFO and the watch stays off. Returns whether it is on."""
        if self.transport is None:
            return False
        why = None
        try:
            self.transport.connect(timeout)
            for f in (HELLO_FILTER, PROGRESS_FILTER):
                if not self.transport.subscribe(f, qos=0, timeout=timeout, retry=False):
                    why = f"the broker refused the subscription to {f} (an ACL?) or did not answer in {timeout:.0f} s"
                    break
        except (TransportError, OSError) as e:
            why = f"could not open a second broker connection: {clip(str(e), 200)}"
        if why is not None:
            log.info("not telling devices with a mistyped federation name (a near miss of %r) what is wrong: %s",
                     self.federation, why)
            self.close()
            return False
        self.active = True
        log.debug("watching the hellos of every federation for near misses of %r", self.federation)
        return True

    def close(self) -> None:
        """Disconnect (idempotent); the rate-limited log's last summary is written."""
        self.active = False
        self._log.flush(force=True)
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception as e:  # best effort on the way out
                log.debug("closing the near-miss watch: %s", e)

    def poll(self) -> None:
        """Handle the messages received so far (at most :data:`POLL_MAX`); never blocks or raises."""
        if not self.active or self.transport is None:
            return
        for _ in range(POLL_MAX):
            m = self.transport.get(0)
            if m is None:
                break
            self.handle(m.topic, m.payload)
        self._log.flush()

    # ------------------------------------------------------------------ one message
    def handle(self, topic: str, payload: bytes) -> str | None:
        """One message of the watch. Returns the reject's reason when it was answered (also
        published, fire-and-forget, when there is a transport), else None. Never raises."""
        parts = topic.split("/")
        if len(parts) < 5 or "/".join(parts[:2]) != ROOT or parts[2] == self.federation or not payload:
            return None
        federation = parts[2]
        if parts[3:] == ["cloud", "progress"]:
            self._served.pop(federation, None)
            self._served[federation] = self.clock()
            while len(self._served) > MAX_SERVED:
                self._served.popitem(last=False)
            return None
        if len(parts) != 7 or parts[3] != "dev" or parts[5:] != ["up", "hello"] or not self._is_near(federation):
            return None
        device_id, now = parts[4], self.clock()
        served = self._served.get(federation)
        if served is not None and now - served < SERVED_S:  # another federation after all
            return None
        if len(payload) > MAX_HELLO_BYTES:
            return self._ignore("oversized", federation, device_id)
        try:
            check_id(device_id, "device id")
            if parse_message(payload, Hello).device_id != device_id:
                return self._ignore("device id is not the topic's", federation, device_id)
        except (MessageError, ValueError):
            return self._ignore("not a valid hello", federation, device_id)
        key = (federation, device_id)
        self._forget(now)
        first = self._seen.get(key)
        if first is None:
            if now - self._minute >= 60.0:
                self._minute, self._new = now, 0
            if self._new >= MAX_NEW_DEVICES_PER_MIN:
                return self._ignore("over the bound of new devices a minute", federation, device_id)
            self._new += 1
            self._seen[key] = now
            self._count("pending")
            log.debug("hello of %s in federation %r (a near miss of %r): answered if it comes again in %.0f s "
                      "or more", device_id, federation, self.federation, GRACE_S)
            return None
        if now - first < GRACE_S:
            return None
        del self._seen[key]
        self._seen[key] = now  # last, as the newest; its next answer comes a grace later at the earliest
        reason = near_miss_reason(federation, self.federation)
        self.answered += 1
        self._count("answered")
        self._log.log("answered", logging.INFO, "device %s sent its hello to federation %r again unanswered; told "
                      "it: did you mean %r?", device_id, federation, self.federation)
        if self.transport is not None:
            try:
                msg = Command(command="reject", reason=reason, kind="hello")
                self.transport.publish_nowait(Topics(federation).down(device_id, "command"), encode(msg))
            except Exception as e:  # best effort, like every reject
                self._log.log("reply failed", logging.WARNING, "could not answer %s of federation %r: %s",
                              device_id, federation, clip(str(e), 200))
        return reason

    def _is_near(self, federation: str) -> bool:
        near = self._near.get(federation)
        if near is None:
            if len(self._near) >= 4096:
                self._near.clear()
            try:
                check_id(federation, "federation")
                near = bool(close_matches(federation, [self.federation], n=1))
            except ValueError:
                near = False
            self._near[federation] = near
        return near

    def _forget(self, now: float) -> None:
        while self._seen:
            key, t = next(iter(self._seen.items()))
            if now - t < FORGET_S:
                break
            del self._seen[key]

    def _ignore(self, why: str, federation: str, device_id: str) -> None:
        """Count and debug-log a dropped near-miss hello; returns None (for :meth:`handle`)."""
        self.ignored += 1
        self._count("ignored")
        log.debug("ignored the hello of %s in federation %r: %s", clip(device_id), clip(federation), why)
        return None

    def _count(self, outcome: str) -> None:
        if self.on_count is not None:
            self.on_count(outcome)
