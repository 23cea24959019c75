"""What the devices did lately, for the operator's views (``fedmoe status``, the dashboard):
when each device was last heard from, and a bounded history of refused messages and of
devices a round left out, each with its reason and time.

Kept in memory and written to the store at most every :data:`FLUSH_S` seconds (a device
sends an update in hundreds of chunks: the store is not written per message), under two
JSON documents: ``activity/last_seen`` (device id -> Unix seconds) and ``activity/events``
(the last :data:`MAX_EVENTS` events, oldest first, each ``{"time", "kind", "device",
"round", "reason"}``; ``kind`` is ``reject`` or ``exclude``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

LAST_SEEN_KEY, EVENTS_KEY = "activity/last_seen", "activity/events"
MAX_EVENTS = 100
"""Events kept (the latest)."""
FLUSH_S = 2.0
"""Least seconds between two writes of the store."""
MAX_REASON = 300
"""Characters of a reason kept."""


class Activity:
    """Last-seen times and recent events of one aggregator, persisted throttled.

    Args:
        store: a ``cloud.store.Store``; what an earlier run kept there is carried on.
        enabled: False keeps nothing (an aggregator worker: the coordinator sharing its
            store keeps the record, and two writers would overwrite each other's).
    """

    def __init__(self, store: Any, enabled: bool = True):
        self.store, self.enabled = store, enabled
        self.last_seen: dict[str, float] = dict(store.get_json(LAST_SEEN_KEY, {}) or {})
        self.events: deque[dict[str, Any]] = deque(store.get_json(EVENTS_KEY, []) or [], maxlen=MAX_EVENTS)
        self._dirty, self._written = False, 0.0

    def seen(self, device_id: str, now: float | None = None) -> None:
        """A message came from ``device_id`` (any kind)."""
        if not self.enabled:
            return
        self.last_seen[device_id] = time.time() if now is None else now
        self._dirty = True
        self.flush()

    def event(self, kind: str, device: str | None, round_: int | None, reason: str, now: float | None = None) -> None:
        """Keep one event: ``kind`` ``reject`` (a refused message) or ``exclude`` (a round
        left the device out), with the round it concerns (None: unknown) and why."""
        if not self.enabled:
            return
        self.events.append({"time": time.time() if now is None else now, "kind": kind,
                            "device": None if device is None else str(device)[:64],
                            "round": round_, "reason": str(reason)[:MAX_REASON]})
        self._dirty = True
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Write what changed if :data:`FLUSH_S` passed since the last write (or ``force``).
        A store failure is logged and retried on the next call: the views must not stop
        the service."""
        now = time.monotonic()
        if not self._dirty or (not force and now - self._written < FLUSH_S):
            return
        try:
            with self.store.transaction():
                self.store.put_json(LAST_SEEN_KEY, self.last_seen)
                self.store.put_json(EVENTS_KEY, list(self.events))
        except Exception as e:  # StoreError: the service's own store calls report it
            log.warning("could not store device activity: %s", str(e)[:200])
            return
        self._dirty, self._written = False, now


def read(store: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(last seen per device, events oldest first) as stored by :class:`Activity`."""
    return store.get_json(LAST_SEEN_KEY, {}) or {}, store.get_json(EVENTS_KEY, []) or []
