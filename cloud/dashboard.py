"""The aggregator's live dashboard (issue 17): a read-only page and its JSON.

``fedmoe aggregator --dashboard HOST:PORT`` serves (standard-library WSGI, one thread per
request; the page's HTML, JS and CSS ship in ``cloud/dashboard_static/``, nothing is fetched
from elsewhere):

- ``/``: the page; it polls ``/api/state`` every 2 s and draws the open round (elapsed
  against its deadline, who was selected, reported, refused or failed), the rounds
  (accuracy and loss on separate charts, or perplexity; MiB up and down on a log scale,
  since round 1's shard download dwarfs later adapter traffic), the device table with
  when each was last heard from, the recent rejected messages and exclusions, the
  expert-load heatmap of every MoE layer (rounds x experts, tokens routed, with its colour
  scale), the strategy with its parameters, and alerts.
- ``/api/state``: :func:`state` as JSON, read from the store (what ``fedmoe status``
  prints) plus the service's live view (who is online now, the open round).

Read-only: only GET and HEAD are answered. With ``dashboard_token`` set, every request
needs it, as ``Authorization: Bearer <token>`` or as the password of HTTP basic auth (any
user name: a browser asks once); compared in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import math
import threading
import time
from importlib import resources
from typing import Any, Callable

from . import activity
from .observability import WsgiListener

log = logging.getLogger(__name__)

STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}
"""Path -> (file in ``cloud/dashboard_static``, content type)."""
MAX_ROUNDS = 200
"""Rounds the page gets (the latest)."""


def budget_peak(device: dict[str, Any]) -> int | None:
    """A round record's entry for one device -> the peak (bytes) its budget is held
    against: ``peak_bytes`` (the footprint from protocol 1.5 devices), or
    ``peak_rss_bytes`` in records written before it; None when neither is there."""
    return device.get("peak_bytes") or device.get("peak_rss_bytes")


def open_round(store: Any, engine: Any = None, events: list[dict] | None = None,
               now: float | None = None) -> dict[str, Any] | None:
    """The round in flight as the store holds it (``current_round`` and its ``inflight/``
    messages, :mod:`cloud.rounds.recovery`), or None when no round is open.

    Args:
        engine: the live round engine, where given: its deadline (a resumed round's is
            moved later in memory only).
        events: :mod:`cloud.activity` events: a selected device with a refused message in
            this round that has not reported counts as failed.
        now: Unix seconds (default: the clock).

    Returns:
        ``{"round", "started", "deadline", "timeout_s", "elapsed_s" (seconds), "selected",
        "accepted" (acknowledged its assignment), "reported", "refused" (declined its
        assignment or failed in training, with the reason), "failed" (a message of it was
        refused, with the reason), "excluded" (left out, with the reason)}``; device ids
        sorted, Unix seconds.
    """
    cur = store.get_json("current_round")
    if cur is None:
        return None
    n, now = int(cur["number"]), time.time() if now is None else now
    live = getattr(engine, "current", None) if engine is not None else None
    deadline = float(live.deadline if live is not None and live.number == n else cur["deadline"])
    prefix = f"inflight/{n}/"
    keys = store.json_keys(prefix)
    by = {}  # what -> devices (keys "inflight/{n}/{what}/{device}")
    for k in keys + store.blob_keys(prefix):
        what, _, device = k[len(prefix):].partition("/")
        by.setdefault(what, set()).add(device)
    selected = sorted(cur.get("selected") or {})
    uploaded = by.get("update", set()) | by.get("folded", set())
    reported = sorted(d for d in by.get("stats", set()) if d in uploaded)
    acks = store.json_many([f"{prefix}ack/{d}" for d in sorted(by.get("ack", ()))])
    refused = {k.rsplit("/", 1)[1]: a.get("reason") or "" for k, a in acks.items() if not a.get("accepted")}
    failed = {k.rsplit("/", 1)[1]: str(v) for k, v in store.json_many(
        [f"{prefix}rejected/{d}" for d in sorted(by.get("rejected", ()))]).items()}
    for e in events or []:
        if e.get("round") == n and e.get("kind") == "reject" and e.get("device") in selected:
            failed.setdefault(e["device"], e.get("reason") or "")
    failed = {d: why for d, why in failed.items() if d not in reported and d not in refused}
    return {"round": n, "started": cur["started"], "deadline": deadline, "timeout_s": deadline - cur["started"],
            "elapsed_s": now - cur["started"], "selected": selected,
            "accepted": sorted(k.rsplit("/", 1)[1] for k, a in acks.items() if a.get("accepted")),
            "reported": reported, "refused": refused, "failed": failed, "excluded": cur.get("excluded") or {}}


def state(store: Any, registry: Any = None, engine: Any = None, strategy: dict | None = None,
          federation: str = "") -> dict[str, Any]:
    """What the page shows, from the store (and the live service where given).

    Returns:
        ``{"federation", "strategy": {name, params}, "initial": {accuracy, loss, perplexity}
        of the global model before round 1 (None until evaluated), "rounds": [{round, status, started,
        accuracy, loss, perplexity, bytes_up, bytes_down, seconds, reported, selected,
        excluded, cv}], "devices": [{device_id, task, online, last_seen, budget_bytes,
        baseline_bytes, experts_held, peak_bytes, last_round, excluded}], "heatmap":
        {layer: {"rounds": [r...], "load": [[tokens per expert] per round]}}, "alerts":
        [str], "current_round": int | None, "open_round": :func:`open_round`, "events":
        [:mod:`cloud.activity` event], newest first, "now": Unix seconds}`` (bytes in
        bytes, seconds in seconds, times in Unix seconds; ``started`` and ``last_seen``
        None where the store has none).
    """
    devices, records = store.devices(), store.rounds()[-MAX_ROUNDS:]
    seen_at, events = activity.read(store)
    live = {d.device_id: d.online for d in registry.devices.values()} if registry is not None else {}
    last_seen: dict[str, dict] = {}
    rounds, heat, alerts = [], {}, []
    for r in records:
        for d, v in (r.get("devices") or {}).items():
            last_seen[d] = {**v, "round": r["round"]}
            peak, budget = budget_peak(v), v.get("budget_bytes")
            if peak and budget and peak > budget:
                alerts.append(f"round {r['round']}: {d} over budget ({peak / 2**20:.0f} of {budget / 2**20:.0f} MiB)")
        if r.get("status", "ok") != "ok":
            alerts.append(f"round {r['round']}: {r.get('status')}" + (f" ({r['error']})" if r.get("error") else ""))
        rounds.append({"round": r["round"], "status": r.get("status", "ok"), "started": r.get("started"),
                       "accuracy": r.get("accuracy"),
                       "loss": r.get("loss"), "perplexity": r.get("perplexity"), "bytes_up": r.get("bytes_up"),
                       "bytes_down": r.get("bytes_down"), "seconds": r.get("seconds"),
                       "reported": len(r.get("devices") or {}), "selected": len(r.get("selected") or []),
                       "excluded": r.get("excluded") or {}, "cv": r.get("cv")})
        for layer, load in (r.get("expert_load") or {}).items():
            h = heat.setdefault(str(layer), {"rounds": [], "load": []})
            h["rounds"].append(r["round"])
            h["load"].append([float(x) for x in load])
    excluded = (records[-1].get("excluded") or {}) if records else {}
    table = []
    for d, info in sorted(devices.items()):
        seen = last_seen.get(d, {})
        seen_times = [t for t in (seen_at.get(d), info.get("last_seen")) if t is not None]
        table.append({"device_id": d, "task": info.get("task"), "online": live.get(d, bool(info.get("online"))),
                      "last_seen": max(seen_times) if seen_times else None,
                      "budget_bytes": info.get("budget_bytes"), "baseline_bytes": info.get("runtime_bytes"),
                      "experts_held": sum(len(e) for e in (seen.get("experts") or {}).values()) if seen else None,
                      "peak_bytes": budget_peak(seen) if seen else None, "last_round": seen.get("round"),
                      "excluded": excluded.get(d)})
    current = getattr(getattr(engine, "current", None), "number", None) if engine is not None else None
    first = store.get_json("initial_evaluation", None) or {}
    initial = {k: first.get(k) for k in ("accuracy", "loss", "perplexity")} if first else None
    return {"federation": federation, "strategy": strategy or {}, "initial": initial, "rounds": rounds, "devices": table,
            "heatmap": heat, "alerts": alerts[-50:], "current_round": current,
            "open_round": open_round(store, engine, events), "events": events[::-1], "now": time.time()}


class Dashboard(WsgiListener):
    """The dashboard of one aggregator (``cloud.service.Aggregator``).

    Args:
        service: read at request time (store, registry, engine, config).
        token: required of every request when set (see the module docstring).
    """

    name = "fedmoe-dashboard"

    def __init__(self, service: Any, token: str | None = None):
        self.service, self.token = service, token
        self._lock = threading.Lock()

    def state(self) -> dict[str, Any]:
        """:func:`state` of the service."""
        s, cfg = self.service, self.service.cfg
        strategy = {"name": cfg.strategy.name, "params": cfg.strategy.params,
                    "assignment": cfg.assignment.name, "aggregation": cfg.aggregation.name}
        with self._lock:  # one store read at a time, whatever the number of open pages
            return state(s.store, s.registry, s.engine, strategy, cfg.federation)

    def _authorised(self, environ: dict) -> bool:
        if not self.token:
            return True
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, value = header.partition(" ")
        given = ""
        if scheme.lower() == "bearer":
            given = value.strip()
        elif scheme.lower() == "basic":
            try:
                given = base64.b64decode(value.strip(), validate=True).decode("utf-8", "replace").partition(":")[2]
            except (binascii.Error, ValueError):
                given = ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def app(self, environ: dict, start_response: Callable) -> list[bytes]:
        """The WSGI application (see the module docstring)."""
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            return _send(start_response, "405 Method Not Allowed", b"read-only\n", "text/plain", [("Allow", "GET")])
        if not self._authorised(environ):
            return _send(start_response, "401 Unauthorized", b"token required\n", "text/plain",
                         [("WWW-Authenticate", 'Basic realm="fedmoe"')])
        if path == "/api/state":
            try:
                body = json.dumps(_finite(self.state()), allow_nan=False, default=str).encode()
            except Exception as e:  # a store hiccup must not take the page down: say so, keep serving
                log.warning("dashboard state failed: %s", str(e)[:200])
                return _send(start_response, "503 Service Unavailable", str(e)[:200].encode(), "text/plain")
            return _send(start_response, "200 OK", body, "application/json", head=method == "HEAD")
        if path in STATIC:
            name, ctype = STATIC[path]
            data = resources.files("cloud").joinpath("dashboard_static", name).read_bytes()
            return _send(start_response, "200 OK", data, ctype, head=method == "HEAD")
        return _send(start_response, "404 Not Found", b"not found\n", "text/plain")


def _finite(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _send(start_response: Callable, status: str, body: bytes, ctype: str, extra: list | None = None,
          head: bool = False) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                            ("Content-Security-Policy", "default-src 'self'"), *(extra or [])])
    return [] if head else [body]
