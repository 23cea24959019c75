"""The aggregator's operator endpoints: Prometheus metrics and health checks (issue 17).

``fedmoe aggregator --metrics HOST:PORT`` serves, on one HTTP listener (standard-library
WSGI server, one thread per request):

- ``/metrics``: Prometheus text exposition of this aggregator's own registry
  (``prometheus_client``); the names follow Prometheus conventions (``fedmoe_*_total``
  counters, ``_seconds`` and ``_bytes`` units).
- ``/healthz``: 200 while the process serves (liveness).
- ``/readyz``: 200 when the broker connection is up and the store answers a query, else
  503 with the reason (readiness).

Series (labels in braces; every label value comes from a bounded set: a round status, a
task the federation trains, an MoE layer, or a reason *class*, the reason's words with
numbers and quoted values blanked, at most :data:`MAX_REASONS` distinct, then ``other``):

======================================================  =========================================
``fedmoe_rounds_opened_total``                          rounds started
``fedmoe_rounds_closed_total{status}``                  rounds closed (``ok``, ``no_quorum``, ...)
``fedmoe_rounds_failed_total``                          rounds closed without a new global model
``fedmoe_round_duration_seconds``                       histogram, open to close
``fedmoe_devices_online`` / ``_registered``              gauges, read at scrape time
``fedmoe_devices_selected`` / ``_reported``              the current (else last) round
``fedmoe_round_open_seconds``                           seconds the open round has run (0: none open)
``fedmoe_round_timeout_seconds``                        the open round's deadline, from its start (0: none)
``fedmoe_devices_excluded_total{reason}``               device-rounds left out, by reason class
``fedmoe_updates_accepted_total``                       updates taken into a round
``fedmoe_messages_rejected_total{reason}``              refused messages, by reason class
``fedmoe_foreign_hellos_total{outcome}``                hellos of near-miss federations (``cloud.near_miss``):
                                                        ``answered`` (did you mean), ``pending``, ``ignored``
``fedmoe_received_bytes_total`` / ``_sent_bytes_total``  MQTT PUBLISH bytes on the wire
``fedmoe_store_write_seconds``                          histogram, persisting a closed round
``fedmoe_expert_load_cv{layer}``                        FLEX-MoE eq. 8 over the load window
``fedmoe_expert_load_max_min_gap{layer}``               FLEX-MoE eq. 9, tokens
``fedmoe_global_accuracy{task}`` / ``_loss`` / ``_perplexity``  after the last closed round
``process_resident_memory_bytes`` etc.                  ``prometheus_client``'s process collector
======================================================  =========================================
"""

from __future__ import annotations

import logging
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily

from protocol.logsafe import reason_class

log = logging.getLogger(__name__)

MAX_REASONS = 50
"""Distinct reason label values per series; later ones are counted as ``other``."""
ROUND_SECONDS_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class _Bounded:
    """Label values for one series, at most :data:`MAX_REASONS`, then ``other``."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.seen or len(self.seen) < MAX_REASONS:
            self.seen.add(value)
            return value
        return "other"


class _Traffic:
    """Collector of the transport's byte counters (read at scrape time)."""

    def __init__(self, transport: Callable[[], Any]):
        self.transport = transport

    def collect(self) -> Iterable[CounterMetricFamily]:
        t = self.transport()
        for name, attr, doc in (("fedmoe_received_bytes", "bytes_received", "MQTT PUBLISH bytes received"),
                                ("fedmoe_sent_bytes", "bytes_sent", "MQTT PUBLISH bytes sent")):
            yield CounterMetricFamily(name, doc, value=float(getattr(t, attr, 0) or 0))


class WsgiListener:
    """A WSGI application (:meth:`app`) served on one address from a daemon thread
    (standard-library server, one thread per request, no request log)."""

    name = "fedmoe-http"
    _server: WSGIServer | None = None

    def app(self, environ: dict, start_response: Callable) -> list[bytes]:
        """The WSGI application to serve (a subclass's)."""
        raise NotImplementedError

    def serve(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port.

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = make_server(host, port, self.app, _ThreadingServer, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name=self.name, daemon=True).start()
        bound = self._server.server_address[1]
        log.info("%s on http://%s:%d/", self.name, host, bound)
        return bound

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class AggregatorMetrics(WsgiListener):
    """The metrics of one aggregator (its own registry, so several can share a process).

    Args:
        service: the ``cloud.service.Aggregator`` (read at scrape time: registry,
            transport, store, engine).
    """

    name = "fedmoe-metrics"

    def __init__(self, service: Any):
        self.service = service
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        r.register(_Traffic(lambda: service.transport))
        self.rounds_opened = Counter("fedmoe_rounds_opened", "Rounds started", registry=r)
        self.rounds_closed = Counter("fedmoe_rounds_closed", "Rounds closed, by status", ["status"], registry=r)
        self.rounds_failed = Counter("fedmoe_rounds_failed", "Rounds closed without a new global model", registry=r)
        self.round_seconds = Histogram("fedmoe_round_duration_seconds", "Round duration, open to close",
                                       buckets=ROUND_SECONDS_BUCKETS, registry=r)
        self.store_seconds = Histogram("fedmoe_store_write_seconds", "Time to persist a closed round", registry=r)
        self.excluded = Counter("fedmoe_devices_excluded", "Device-rounds left out, by reason class", ["reason"],
                                registry=r)
        self.accepted = Counter("fedmoe_updates_accepted", "Updates taken into a round", registry=r)
        self.rejected = Counter("fedmoe_messages_rejected", "Refused messages, by reason class", ["reason"],
                                registry=r)
        self.foreign_hellos = Counter("fedmoe_foreign_hellos", "Hellos on a federation name that is a near miss of "
                                      "this one's: answered (did you mean), pending (first seen), ignored (junk, "
                                      "over the bound)", ["outcome"], registry=r)
        Gauge("fedmoe_devices_online", "Registered devices online now", registry=r).set_function(
            lambda: len(service.registry.online()))
        Gauge("fedmoe_devices_registered", "Registered devices", registry=r).set_function(
            lambda: len(service.registry.devices))
        self.selected = Gauge("fedmoe_devices_selected", "Devices selected for the current (else last) round",
                              registry=r)
        self.reported = Gauge("fedmoe_devices_reported", "Devices whose update the current (else last) round "
                                                         "accepted", registry=r)
        self.load_cv = Gauge("fedmoe_expert_load_cv", "Expert-load CV over the window (FLEX-MoE eq. 8)", ["layer"],
                             registry=r)
        self.load_gap = Gauge("fedmoe_expert_load_max_min_gap", "Expert-load max-min gap, tokens (FLEX-MoE eq. 9)",
                              ["layer"], registry=r)
        self.accuracy = Gauge("fedmoe_global_accuracy", "Global model accuracy after the last round", ["task"],
                              registry=r)
        self.loss = Gauge("fedmoe_global_loss", "Global model loss after the last round", ["task"], registry=r)
        self.perplexity = Gauge("fedmoe_global_perplexity", "Global model perplexity after the last round (causal "
                                                            "LM tasks)", ["task"], registry=r)
        self.round = Gauge("fedmoe_round", "The last round number opened", registry=r)
        Gauge("fedmoe_round_open_seconds", "Seconds the open round has run (0: no round open)",
              registry=r).set_function(lambda: _open_round(service, lambda o: time.time() - o.started))
        Gauge("fedmoe_round_timeout_seconds", "The open round's deadline, seconds from its start (0: no round open)",
              registry=r).set_function(lambda: _open_round(service, lambda o: o.deadline - o.started))
        self._reject_reasons, self._exclude_reasons = _Bounded(), _Bounded()
        self._metrics_app = make_wsgi_app(self.registry)

    # ------------------------------------------------------------------ events
    def on_progress(self, event: str, round_: int, detail: dict) -> None:
        """The engine's progress events (``round_start``, ``report``)."""
        if event == "round_start":
            self.rounds_opened.inc()
            self.round.set(round_)
            self.selected.set(len(detail.get("devices") or ()))
            self.reported.set(0)
            for why in (detail.get("excluded") or {}).values():
                self.excluded.labels(self._exclude_reasons(reason_class(why))).inc()
        elif event == "report":
            self.accepted.inc()
            self.reported.inc()

    def on_reject(self, reason: str) -> None:
        """A refused message (the service's reject or drop)."""
        self.rejected.labels(self._reject_reasons(reason_class(reason))).inc()

    def on_foreign_hello(self, outcome: str) -> None:
        """A hello of a near-miss federation (``cloud.near_miss``): ``answered``, ``pending`` or ``ignored``."""
        self.foreign_hellos.labels(outcome if outcome in ("answered", "pending", "ignored") else "other").inc()

    def on_record(self, record: dict, store_seconds: float | None = None) -> None:
        """A closed round's record (``cloud.rounds``) and the time persisting it took."""
        status = str(record.get("status", "ok"))[:40]
        self.rounds_closed.labels(status).inc()
        if status == "failed" or record.get("accuracy") is None and status != "ok":
            self.rounds_failed.inc()
        if record.get("seconds") is not None:
            self.round_seconds.observe(float(record["seconds"]))
        if store_seconds is not None:
            self.store_seconds.observe(store_seconds)
        self.reported.set(len(record.get("devices") or {}))
        for layer, v in (record.get("cv_per_layer") or {}).items():
            self.load_cv.labels(str(layer)).set(float(v))
        for layer, v in (record.get("max_min_gap_per_layer") or {}).items():
            self.load_gap.labels(str(layer)).set(float(v))
        for task, ev in (record.get("per_task") or {}).items():
            for gauge, key in ((self.accuracy, "accuracy"), (self.loss, "loss"), (self.perplexity, "perplexity")):
                if ev.get(key) is not None:
                    gauge.labels(task).set(float(ev[key]))

    # ------------------------------------------------------------------ HTTP
    def ready(self) -> tuple[bool, str]:
        """(ready, reason): the broker connection is up and the store answers."""
        if not self.service.transport.connected:
            return False, "broker not connected"
        try:
            self.service.store.ping()
        except Exception as e:  # any store failure makes the service unready
            return False, f"store not reachable: {str(e)[:200]}"
        return True, "ok"

    def app(self, environ: dict, start_response: Callable) -> list[bytes]:
        """The WSGI application: ``/metrics``, ``/healthz``, ``/readyz``; 404 otherwise."""
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok")
        if path == "/readyz":
            ok, why = self.ready()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable", why)
        return _text(start_response, "404 Not Found", "not found: /metrics, /healthz, /readyz")

def _open_round(service: Any, value: Callable[[Any], float]) -> float:
    """``value`` of the service's open round (``cloud.rounds.OpenRound``), or 0 when none is open."""
    rnd = getattr(getattr(service, "engine", None), "current", None)
    return float(value(rnd)) if rnd is not None else 0.0


def _text(start_response: Callable, status: str, body: str) -> list[bytes]:
    data = (body + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))])
    return [data]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not for the log
        pass


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) -> (host, port).

    Raises:
        ValueError: no port, or a port outside 0..65535.
    """
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds it took)``."""
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0
