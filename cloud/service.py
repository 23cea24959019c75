"""The aggregator service: MQTT wiring, message validation, main loop (its configuration
schema is :mod:`cloud.config`; ``AggregatorConfig`` & co. are re-exported here).

``fedmoe aggregator --broker mqtt://HOST:PORT --config aggregator.yaml`` runs
:class:`Aggregator`. Every incoming message is validated before it reaches the round
engine (schema, topic/device-id agreement, known device, chunk checksums, size
limits); a message that fails is logged with its reason and, where a device can be
named, answered on that device's ``down/command`` topic with a ``reject``. Floods of
junk stay cheap: junk is refused by cheap checks before its payload is parsed (the reply
names the round and upload id a bounded scan of its first 4 KiB finds), rejections
are logged rate-limited (a few lines, then a summary a minute), and replies are capped
per device and never wait for a PUBACK (:meth:`Aggregator._handle`, :meth:`Aggregator._reject`).

Security (``device_keys`` set, see ``fedmoe provision``): only provisioned devices may
register, and every update chunk and stats message must carry a valid Ed25519
signature of its device (:mod:`protocol.signing`); unsigned, forged, replayed and
mismatched (topic vs. signed device) messages are rejected. The MQTT account and TLS
come from ``credentials`` / ``tls_ca``.

Durability: the aggregator's MQTT session is persistent (fixed client id,
``clean_start`` false once the store holds state, ``session_expiry_s``), so QoS 1
messages published while it is down are delivered when it comes back; a restarted
aggregator resumes the open round from its store, drains what the broker queued for it,
re-sends assignments to devices that have not reported, and closes the round as usual.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from moe_model.budget import tune_allocator
from edge_sdk.data import encode_labels, load_text_file
from protocol.chunking import MAGIC, MAX_HEADER, ChunkError, Reassembler, parse_chunk
from protocol.logsafe import LogLimiter, RateLimiter, clip, reason_class
from protocol.signing import SignatureError
from protocol.messages import (
    MAX_CONTROL_BYTES, MAX_INT, Ack, Command, Hello, MessageError, Progress, Stats, Status, encode, parse_message,
)
from protocol.topics import PARTITIONED_KINDS, UP_KINDS, Topics, check_id
from protocol.transport import Incoming, Transport, TlsConfig

from .activity import Activity
from .config import (  # noqa: F401  (re-exported)
    CLUSTER_RESEND_S, AggregatorConfig, FederationSettings, StrategyConfig, TaskConfig,
)
from .filters import InboundFilter, Verification
from .dashboard import Dashboard
from .global_model import GlobalModel
from .near_miss import NearMissHellos
from .observability import AggregatorMetrics, parse_address
from .programs import ProgramPublisher
from .registry import Registry
from .robust.defences import Defences
from .rounds import RoundEngine, RoundSettings
from .shard_publisher import ShardPublisher
from .store import Store, StoreError, redact_url
from .workers import FLUSH_S, REFRESH_S, WORKER_STALE_S, Coordinator, Ingest, sums_mode
from .strategies import get_strategy
from .strategies.base import Strategy
from .strategy import Setup

log = logging.getLogger(__name__)


SERVICE_MMAP_THRESHOLD = 16 << 20
"""Allocations of at least this many bytes are mmapped (:func:`moe_model.budget.tune_allocator`).
A fixed threshold stops glibc from moving it after each large free (its default), which
let round-sized buffers land in the heap and fragment it: with 16 MiB and a
``malloc_trim`` after each round, the aggregator's RSS grew 0.67 MiB from round 11 to 60
instead of 2.2 MiB (tiny model, 2 devices), for 5% slower evaluation of the real
MiniLM-MoE (5.47 vs 5.19 s for BBC's test split; a 1 MiB threshold: 0.4 MiB, but 38%
slower)."""


LEADER_CHECK_S = 5.0
"""How often (seconds) the aggregator checks that it still holds its store's leader lock."""
BATCH_MESSAGES = 64
BATCH_S = 0.2
"""Group commit (:meth:`Aggregator._pump`): the messages handled in one store transaction,
at most this many or for this many seconds, are acknowledged to the broker after it
commits. With one commit per message the store took 11.3 ms of a 1 MiB update's 34.8 ms of CPU
(results/fleet/profile_baseline.md)."""
RECEIVE_MAXIMUM = 4 * BATCH_MESSAGES
INBOX_MAX_BYTES = 64 * 2**20
"""Flow control: received messages the broker may leave unacknowledged with the aggregator
(MQTT 5 Receive Maximum), and the payload bytes its inbox holds before paho's network thread
stops reading (``protocol.transport.Transport``): a backlog of uploads waits in the broker,
not in the aggregator's memory."""


class Aggregator:
    """The cloud side of one federation.

    Args:
        config: the aggregator config.
        broker: broker URL.
        eval_data: task -> test items (overrides each task's ``eval_data`` file).
        reserved_data: task -> labelled items only the cloud holds (overrides each task's
            ``reserved_data`` file): ``Setup.reserved``, e.g. Fed-MoE's D^r; never sent.
    """

    def __init__(self, config: AggregatorConfig, broker: str,
                 eval_data: dict[str, Sequence[tuple[Any, Any]]] | None = None,
                 reserved_data: dict[str, Sequence[tuple[Any, Any]]] | None = None):
        # ValueError before the model is set up
        config.check_paths(eval_given=eval_data or (), reserved_given=reserved_data or ())
        tune_allocator(SERVICE_MMAP_THRESHOLD)
        self.cfg = config
        self._batch_progress: list[tuple[str, int, dict]] | None = None
        """Progress events of the batch being handled (:meth:`_pump`), told after it commits."""
        if config.threads:
            import torch

            torch.set_num_threads(config.threads)
        self.topics = Topics(config.federation)
        self.role = config.role
        self.store = Store(config.store)
        if self.role != "worker":  # workers are many; one coordinator leads
            self._lead(config)
        self._leader_checked = time.monotonic()
        fresh = self.store.is_empty()
        if config.credentials:
            from protocol.credentials import load_credentials

            cred = load_credentials(config.credentials)
            config = config.model_copy(update={
                "username": config.username or cred["username"], "password": config.password or cred.get("password"),
                "tls_ca": config.tls_ca or (cred.get("tls_ca") if broker.startswith(("mqtts", "ssl")) else None)})
            self.cfg = config
        self.verification: Verification | None = None
        if config.device_keys:
            from protocol.credentials import load_device_keys
            from protocol.signing import Verifier

            self.verification = Verification(Verifier(load_device_keys(config.device_keys)), config.max_update_bytes)
            log.info("signatures required; %d device keys loaded", len(self.verification.verifier.keys))
        self.filters: list[InboundFilter] = [self.verification] if self.verification else []
        """The incoming filter chain (:mod:`cloud.filters`) every update chunk and stats
        message passes before the engine; the engine decodes updates with its own."""
        self.registry = Registry(self.store)
        tasks = {name: t.labels for name, t in config.tasks.items()}
        self.model = GlobalModel(config.model, tasks, config.weight_format, formats=config.weight_formats)
        self.eval_data = self._eval_sets(eval_data or {})
        reserved = self._item_sets(reserved_data or {}, "reserved_data", limit=False)
        tls = TlsConfig(config.tls_ca, config.tls_cert, config.tls_key) if config.tls_ca else None
        worker = self.role == "worker"
        self.transport = Transport(
            broker, f"fedmoe-worker-{config.federation}-{config.worker_id}" if worker else
            f"fedmoe-aggregator-{config.federation}", protocol=config.protocol,
            username=config.username, password=config.password, tls=tls, max_payload=config.max_payload,
            clean_start=False if worker else "first_only" if fresh else False,
            session_expiry_s=config.session_expiry_s, manual_ack=True, receive_maximum=RECEIVE_MAXIMUM,
            inbox_max_bytes=INBOX_MAX_BYTES)
        setup = Setup(self.model.layers, config.model.num_experts, config.seed, config.train, tasks,
                      (config.assignment.name, config.assignment.params),
                      (config.aggregation.name, config.aggregation.params), reserved)
        defences = Defences(config.defences)
        strategy = build_strategy(config, setup, defences)
        settings = RoundSettings(config.clients_per_round, config.quorum, config.round_timeout_s, config.train,
                                 config.max_update_bytes, config.eval_batch_size, config.seed,
                                 max_samples_per_device=config.max_samples_per_device,
                                 state_precision=config.state_precision, shard_url=config.shard_url,
                                 state_compression=config.state_compression, min_lora_rank=config.min_lora_rank,
                                 assignment_resend_s=config.assignment_resend_s if config.assignment_resend_s
                                 is not None else CLUSTER_RESEND_S if len(self.transport.nodes) > 1 else 0.0)
        self.engine = RoundEngine(self.model, self.registry, self.store, strategy, self, self.topics, settings,
                                  self.eval_data, self._reject, self._progress, defences=defences)
        self.shards = ShardPublisher(self.model, self.topics, self.transport, config.shard_dir, config.shard_url)
        """The base model's shards for devices (:mod:`cloud.shard_publisher`)."""
        self.engine.ensure_shards = self.shards.ensure
        self.engine.between_sends = self._pump_between_sends
        self._pumped = 0.0  # when _pump last took a batch (monotonic seconds)
        if config.shard_url is not None and config.shard_dir is not None:
            self.engine.programs = ProgramPublisher(self.model, config.shard_dir, config.shard_url,
                                                   config.program_capacity_factor, config.program_ops)
        self.activity = Activity(self.store, enabled=not worker)
        """Last seen per device and recent rejects/exclusions, for the views (:mod:`cloud.activity`)."""
        self.ingest: Ingest | None = None
        """A worker's upload handling (``role: worker``; :mod:`cloud.workers`)."""
        if self.role == "coordinator":
            self.engine.coordinator = Coordinator(self.store)
        if worker:
            self.ingest = Ingest(self.engine, config.worker_id, self._reject, self._progress, config.max_update_bytes)
            self.ingest.refresh(force=True)
        else:
            self.engine.restore()
        self.updates = Reassembler(config.max_update_bytes, verify_chunks=False)
        self._kept: dict[tuple[str, int, str], set[str]] = {}
        """(device, round, upload id) -> store keys of its chunks kept (:meth:`_keep_chunk`)."""
        self._awaited: list[str] = []
        """Offline devices the next round waits for (:meth:`_awaiting_reconnect`)."""
        self._unsaved: dict[str, bytes] = {}
        """Store key -> payload of the kept chunks not yet written: at the end of their batch (:meth:`_save_chunks`)."""
        if self.role == "all":
            self._reload_chunks()
        self.near_miss: NearMissHellos | None = None
        """Answers devices of a mistyped federation name (``near_miss_hellos``; not a worker)."""
        if config.near_miss_hellos and not worker:
            self.near_miss = NearMissHellos(config.federation, Transport(
                broker, f"fedmoe-near-miss-{config.federation}-{uuid.uuid4().hex[:8]}", protocol=config.protocol,
                username=config.username, password=config.password, tls=tls, inbox_max=10_000),
                on_count=lambda outcome: self.metrics is not None and self.metrics.on_foreign_hello(outcome))
        self._synced = 0.0
        self._told_no_worker = False
        self.initial: dict[str, Any] | None = self.store.get_json("initial_evaluation")
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.metrics = AggregatorMetrics(self) if config.metrics else None
        """The operator endpoints (``config.metrics``; :mod:`cloud.observability`)."""
        self.metrics_port: int | None = None
        """The port they listen on while :meth:`run` runs."""
        self.dashboard = Dashboard(self, config.dashboard_token) if config.dashboard else None
        """The live dashboard (``config.dashboard``; :mod:`cloud.dashboard`)."""
        self.dashboard_port: int | None = None
        """The port it listens on while :meth:`run` runs."""
        """Set once :meth:`run` subscribed to the devices' uplink: a message a device
        publishes earlier and does not retain (``hello`` is retained) is not seen."""
        self.rejected = 0
        self.internal_errors = 0
        """Messages dropped because handling them raised an unexpected error (a bug)."""
        self.dropped = 0
        """Rejected messages (also counted in ``rejected``) refused by the cheap early checks,
        before their payload was parsed: malformed topics (no reply), oversize payloads
        and, with signatures, devices that are not provisioned (no reply) and unsigned
        update/stats messages."""
        self._max_topic = (len(f"{self.topics.root}/dev/") + 64 + len("/up/") + max(map(len, UP_KINDS))
                           + 1 + 64)  # "/{uplink partition}"
        self._reject_log = LogLimiter(log, "rejections", per_key=3, total=20, interval_s=60.0)
        """Rejections are logged rate-limited: a flood of junk yields a few lines and a summary a minute."""
        self._replies = RateLimiter(rate=0.5, burst=10)
        """Reject replies per registered device: 10 at once, then one per 2 s; the rest are dropped."""
        self._stranger_replies = RateLimiter(rate=0.5, burst=5, max_keys=1)
        """One budget shared by every device id that never said hello (made-up ids are free)."""
        self._reply_repeats = RateLimiter(rate=0.1, burst=1)
        """One reply per (device, kind of rejection) per 10 s: a device is told once about 50
        unsigned chunks, and a burst of one kind of junk does not use up its budget."""

    def _eval_sets(self, given: dict[str, Sequence[tuple[Any, Any]]]) -> dict[str, list]:
        return self._item_sets(given, "eval_data")

    def _item_sets(self, given: dict[str, Sequence[tuple[Any, Any]]], field: str, limit: bool = True
                   ) -> dict[str, list]:
        """task -> items ``(input, label id)``: the given ones, else the task's ``field``
        file; with ``limit``, at most ``eval_max_samples``."""
        out = {}
        for name, task in self.cfg.tasks.items():
            items = given.get(name)
            path = getattr(task, field)
            if items is None and path:
                items = load_text_file(path).items
            if items:
                items = encode_labels(items, task.labels)
                out[name] = items[: self.cfg.eval_max_samples] if limit and self.cfg.eval_max_samples else items
        return out

    # ------------------------------------------------------------------ Wire (for the engine)
    def publish(self, topic: str, payload: bytes) -> None:
        """:class:`cloud.rounds.Wire`: publish a control message (QoS 1)."""
        self.transport.publish(topic, payload)

    def publish_blob(self, topic: str, data: bytes, kind: str, round: int, transfer_id: str | None = None):
        """:class:`cloud.rounds.Wire`: publish ``data`` as a chunked blob; returns its ``BlobRef``."""
        return self.transport.publish_blob(topic, data, kind, round, transfer_id)

    @property
    def chunk_payload_bytes(self) -> int:
        """:class:`cloud.rounds.Wire`: largest chunk payload in bytes."""
        return self.transport.chunk_payload_bytes

    # ------------------------------------------------------------------ replies / progress
    def _reject(self, device_id: str, round_: int | None, reason: str, *, kind: str | None = None,
                upload_id: str | None = None) -> None:
        """Count and log (rate-limited) a rejected message, and answer ``device_id`` with a
        ``reject`` command if its reply budget allows: one reply per kind of rejection per
        10 s, and per registered device 10 at once, then one per 2 s; ids that never said
        hello share one budget of 5, then one per 2 s. The reply is fire-and-forget, so a
        flood never waits on PUBACK round trips. It names what it refers to: the message
        ``kind``, its ``round`` and the update's ``upload_id`` where known."""
        self.rejected += 1
        if self.metrics is not None:
            self.metrics.on_reject(reason)
        known = self.registry.get(device_id) is not None
        self.activity.event("reject", device_id, round_, reason)
        key = _reason_key(reason, known)
        self._reject_log.log(key, logging.WARNING, "rejected message from %s (round %s): %s", clip(device_id), round_,
                             clip(reason, 300))
        if not self._reply_repeats.allow(f"{device_id}|{key}") or \
                not (self._replies.allow(device_id) if known else self._stranger_replies.allow("")):
            return
        try:
            msg = Command(command="reject", round=round_, reason=reason[:2000], kind=kind, upload_id=upload_id)
            self.transport.publish_nowait(self.topics.down(device_id, "command"), encode(msg))
        except Exception as e:  # the reply is best effort; the rejection stands
            self._reject_log.log("reject reply failed", logging.WARNING, "could not send a reject to %s: %s",
                                 clip(device_id), clip(str(e), 200))

    def _refuse(self, device_id: str, kind: str, payload: bytes, reason: str) -> None:
        """:meth:`_reject` a message of ``kind`` that failed its checks, naming the round
        and upload id that ``payload`` shows (:func:`refers_to`)."""
        round_, upload_id = refers_to(kind, payload)
        self._reject(device_id, round_, reason, kind=kind, upload_id=upload_id)

    def _drop(self, key: str, msg: str, *args: Any) -> None:
        """Refuse junk without a reply: counted in ``rejected`` and ``dropped``, logged
        rate-limited under ``key`` (a reason class, never an id or topic)."""
        self.rejected += 1
        self.dropped += 1
        if self.metrics is not None:
            self.metrics.on_reject(key)
        self.activity.event("reject", None, None, key)
        self._reject_log.log(key, logging.WARNING, msg, *args)

    def _progress(self, event: str, round_: int, detail: dict) -> None:
        if self._batch_progress is not None:  # told once the batch it belongs to is committed (_pump)
            self._batch_progress.append((event, round_, detail))
            return
        if self.metrics is not None:
            self.metrics.on_progress(event, round_, detail)
        if event == "round_start":
            for d, why in (detail.get("excluded") or {}).items():
                self.activity.event("exclude", d, round_, why)
        try:
            msg = Progress(event=event, round=round_, rounds=self.cfg.rounds, detail=detail)
            if event == "report":  # one per update: waiting for each PUBACK held up ingest (and its flow control)
                self.transport.publish_nowait(self.topics.progress(), encode(msg))
            else:
                self.transport.publish(self.topics.progress(), encode(msg), timeout=10)
        except Exception as e:
            self._reject_log.log("progress publish failed", logging.WARNING, "could not publish progress (%s): %s",
                                 event, clip(str(e), 200))

    # ------------------------------------------------------------------ lifecycle
    def _lead(self, config: AggregatorConfig) -> None:
        """Take the store's leader lock: at once, or as a standby, when the leader stops.

        Raises:
            StoreError: another aggregator holds the store and ``config.standby`` is off.
        """
        name = redact_url(config.store)
        if self.store.acquire_leader(wait=config.standby, on_wait=lambda: log.info(
                "standby: another aggregator holds store %s; taking over when it stops", name)):
            if config.standby:
                log.info("leader of store %s", name)
            return
        self.store.close()
        raise StoreError(f"another aggregator holds store {name} (its leader lock); stop it, or start this one "
                         "with --standby to take over when it stops")

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (thread-safe)."""
        self._stop.set()

    def run(self) -> list[dict[str, Any]]:
        """Publish shards, wait for devices, run the configured rounds.

        Returns:
            All round records in the store (including earlier runs when resumed).

        Raises:
            protocol.transport.TransportError: the broker cannot be reached.
            TimeoutError: fewer than ``min_devices`` joined within ``start_timeout_s``, or
                no online device could be assigned a round (every budget too small for
                the strategy) for ``start_timeout_s``.
        """
        self.transport.connect()
        if self.metrics is not None and self.metrics_port is None:
            self.metrics_port = self.metrics.serve(*parse_address(self.cfg.metrics))
        if self.dashboard is not None and self.dashboard_port is None:
            self.dashboard_port = self.dashboard.serve(*parse_address(self.cfg.dashboard))
        if self.role == "coordinator":  # a session that ran as one process also took the uploads
            self.transport.unsubscribe(self.topics.all_up())
            self.engine.coordinator.shared_subscriptions = self.transport.v5
        for up in self._uplink():
            if not self.transport.subscribe(up, timeout=30):
                log.warning("no SUBACK for %s within 30 s; going on (paho resubscribes on reconnect)", up)
        if self.near_miss is not None:
            self.near_miss.start()
        self.ready.set()
        if self.ingest is not None:
            return self._run_worker()
        self.shards.start()
        try:
            resumed = self.engine.current is not None
            if resumed:
                self._resume()
            if self.initial is None:
                self._pump(0.5)  # answer the hellos already there (`registered`) before the evaluation
                log.info("evaluating the initial global model (hellos are answered after it)")
                t0 = time.monotonic()
                self.initial = self.engine.evaluate()
                self.store.put_json("initial_evaluation", self.initial)
                acc = self.initial.get("accuracy")
                log.info("initial accuracy: %s (evaluated in %.0f s)", "-" if acc is None else f"{acc:.4f}",
                         time.monotonic() - t0)
            if not resumed:
                self._wait_for_devices()
            idle_since = None
            while not self._stop.is_set() and self.engine.completed < self.cfg.rounds:
                if self.engine.current is None and self._awaiting_reconnect():
                    self._pump(0.5)
                    continue
                no_worker = self._no_worker() if self.engine.current is None else None
                if self.engine.current is None and (no_worker or not self.engine.start_round()):
                    idle_since = idle_since or time.monotonic()
                    give_up = self.cfg.start_timeout_s if no_worker or self.cfg.assign_timeout_s is None \
                        else self.cfg.assign_timeout_s
                    if time.monotonic() - idle_since > give_up:
                        if no_worker:
                            raise TimeoutError(f"round {self.engine.completed + 1}: {no_worker} for "
                                               f"{self.cfg.start_timeout_s:.0f} s")
                        why = self.engine.plan_error or "; ".join(
                            f"{d}: {r}" for d, r in sorted(self.engine.excluded.items())[:10])
                        raise TimeoutError(
                            f"round {self.engine.completed + 1}: no device could be assigned for "
                            f"{give_up:.0f} s (budgets too small for the "
                            f"'{self.engine.strategy.label}' strategy, the strategy failed, or no eligible device "
                            f"online)" + (f": {why}" if why else ""))
                    self._pump(1.0)
                    continue
                idle_since = None
                while not self._stop.is_set() and not self.engine.should_close():
                    self._pump(0.2)
                    self.engine.resend_unacked()
                if self.engine.current is not None and not self._stop.is_set():
                    record = self.engine.close_round()
                    if self.metrics is not None:
                        self.metrics.on_record(record, self.engine.persist_seconds)
                    self.updates = Reassembler(self.cfg.max_update_bytes, verify_chunks=False)
                    self.store.delete_prefix("chunks/")
                    self._kept.clear()
                    self._unsaved.clear()
                    if self.verification is not None:
                        self.verification.prune(self.engine.completed + 1)
            if self._stop.is_set():
                self._stopping()
                return self.store.rounds()
            self._progress("done", self.engine.completed, {})
            if self.cfg.stop_devices_when_done:
                for dev in self.registry.devices.values():
                    self.transport.publish(self.topics.down(dev.device_id, "command"), encode(Command(command="stop")))
            return self.store.rounds()
        finally:
            self._shutdown()

    def _tell(self, device_id: str, msg: Command) -> None:
        """Send ``msg`` to ``device_id``, fire-and-forget (best effort: logged, not raised)."""
        try:
            self.transport.publish_nowait(self.topics.down(device_id, "command"), encode(msg))
        except Exception as e:
            self._reject_log.log(f"{msg.command} reply failed", logging.WARNING, "could not send %s to %s: %s",
                                 msg.command, clip(device_id), clip(str(e), 200))

    def _stopping(self) -> None:
        """:meth:`stop` ended :meth:`run` before its last round (SIGTERM/SIGINT on ``fedmoe
        aggregator``): say what stays in the store and tell every registered device
        (``stop`` with reason ``aggregator shutting down``, PROTOCOL.md §5.6)."""
        rnd = self.engine.current
        if rnd is not None:
            log.info("stopping: round %d stays open in store %s (persisted at its start); a restarted aggregator "
                     "resumes it", self.engine.completed + 1, redact_url(self.cfg.store))
        else:
            log.info("stopping after %d of %d rounds (store %s; a restarted aggregator goes on from there)",
                     self.engine.completed, self.cfg.rounds, redact_url(self.cfg.store))
        devices = list(self.registry.devices.values())
        for dev in devices:
            self._tell(dev.device_id, Command(command="stop", reason=SHUTDOWN_REASON))
        log.info("told %d registered device(s): stop (%s)", len(devices), SHUTDOWN_REASON)

    def _shutdown(self) -> None:
        """What :meth:`run` ends with, in any role: the log summary, retained shards cleared
        (``clear_retained_on_exit``; only a process that published them: not a worker), the
        broker session closed (ended once the federation is done), the operator endpoints
        stopped, the store closed."""
        self._reject_log.flush(force=True)
        self.activity.flush(force=True)
        if self.near_miss is not None:
            self.near_miss.close()
        if self.cfg.clear_retained_on_exit and self.ingest is None:
            self.shards.clear_retained()
        self.transport.close(end_session=self.engine.completed >= self.cfg.rounds)
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics_port = None
        if self.dashboard is not None:
            self.dashboard.stop()
            self.dashboard_port = None
        self.store.close()

    def _no_worker(self) -> str | None:
        """A coordinator's reason not to start a round: no aggregator worker has announced
        itself in the last :data:`cloud.workers.WORKER_STALE_S` seconds (uploads published
        before any worker subscribed would be lost: the broker keeps them for no one). None
        when a worker is there, or for one process (``role: all``)."""
        if self.engine.coordinator is None:
            return None
        if self.engine.coordinator.live_workers():
            self._told_no_worker = False
            return None
        if not self._told_no_worker:
            log.warning("no aggregator worker is running; rounds wait for one (fedmoe aggregator --role worker "
                        "--worker-id ...)")
            self._told_no_worker = True
        return f"no aggregator worker announced itself within {WORKER_STALE_S:.0f} s"

    def _uplink(self) -> list[str]:
        """The topic filters this process takes: every device uplink (``role: all``); a
        worker the uploads (update, stats) of its uplink partition (``Assignment.uplink``)
        and, on an MQTT 5 broker, those of devices older than protocol minor 9, shared among
        the workers (``$share``); the rest for the coordinator."""
        if self.role == "all":
            return [self.topics.all_up()]
        if self.role == "coordinator":
            return [f"{self.topics.root}/dev/+/up/{kind}" for kind in UP_KINDS if kind not in PARTITIONED_KINDS]
        shared = [f"$share/fedmoe-workers/{self.topics.root}/dev/+/up/{kind}" for kind in PARTITIONED_KINDS]
        return self.topics.partition_filters(self.cfg.worker_id) + (shared if self.transport.v5 else [])

    def _run_worker(self) -> list[dict[str, Any]]:
        """A worker's loop: take uploads until the federation's last round closed or :meth:`stop`."""
        log.info("worker %s taking uploads of federation %s (%s aggregation)", self.cfg.worker_id,
                 self.cfg.federation, "running sums" if sums_mode(self.engine) else "stored for the coordinator")
        try:
            while not self._stop.is_set() and self.engine.completed < self.cfg.rounds:
                self.ingest.announce()
                self.ingest.refresh()
                until = time.monotonic() + FLUSH_S
                m = self.transport.get(FLUSH_S)
                while m is not None:
                    # group commit as in one process, of this worker's own uplink partition only: a message of
                    # the shared subscription (older devices) has a transaction of its own, since there one
                    # upload's chunks are spread over the workers, each takes the upload's lock, and two batches
                    # taking two uploads' locks in opposite orders would deadlock
                    with self.store.transaction():
                        batch, m = self._handle_batch(m, min(until, time.monotonic() + BATCH_S),
                                                      lambda x: self._own_partition(x.topic), wait=True)
                        self.ingest.end_batch()  # what it took committed with the batch, the rest of its chunks stored
                    for done in batch:  # only now: a worker killed before this gets them again from its session
                        self.transport.ack(done)
                    self.ingest.tell()  # reports and screening's rejections of what the batch took
                    if m is None and time.monotonic() < until:
                        m = self.transport.get(0)
                self.ingest.poll()
                self._reject_log.flush()
            return []
        finally:
            self._shutdown()

    def _own_partition(self, topic: str) -> bool:
        """Whether ``topic`` is ``.../up/{kind}/{this worker's id}`` (its uplink partition)."""
        parts = topic.rsplit("/", 3)
        return len(parts) == 4 and parts[1] == "up" and parts[3] == self.cfg.worker_id

    def _resume(self) -> None:
        """Take in what the broker queued while we were down, re-send assignments, and
        keep the resumed round open at least ``resume_drain_s`` more seconds."""
        rnd = self.engine.current
        log.info("resuming round %d (session present: %s); draining queued messages", rnd.number,
                 self.transport.session_present)
        start = last = time.monotonic()
        while time.monotonic() - last < 0.5 and time.monotonic() - start < self.cfg.resume_drain_s:
            m = self.transport.get(0.1)
            if m is not None:
                self._handle(m.topic, m.payload, m.properties)
                self.transport.ack(m)
                last = time.monotonic()
        self.engine.sync()  # what the workers took (coordinator): those devices are not sent their assignment again
        n = self.engine.resend_assignments()
        rnd.deadline = max(rnd.deadline, time.time() + self.cfg.resume_drain_s)
        log.info("round %d resumed: %d/%d reported, assignment re-sent to %d devices", rnd.number,
                 sum(rnd.reported(d) for d in rnd.selected), len(rnd.selected), n)

    def _awaiting_reconnect(self) -> bool:
        """Whether the next round waits for registered devices that went offline less than
        ``reconnect_grace_s`` ago (a broker failover in progress); logged once per such set."""
        now, grace = time.time(), self.cfg.reconnect_grace_s
        waiting = [d.device_id for d in self.registry.offline() if now - d.last_seen < grace]
        if waiting and waiting != self._awaited:
            log.info("round %d waits up to %.0f s for %d device(s) that went offline to reconnect: %s",
                     self.engine.completed + 1, grace, len(waiting), ", ".join(clip(d) for d in waiting[:10]))
        self._awaited = waiting
        return bool(waiting)

    def _wait_for_devices(self) -> None:
        deadline = time.time() + self.cfg.start_timeout_s
        announced = -1
        self._pump(0.5)  # the registrations already queued first: no "0/N online" as they arrive
        while not self._stop.is_set():
            n = len(self.registry.online())
            if n >= self.cfg.min_devices:
                return
            if n != announced:
                log.info("waiting for devices: %d/%d online", n, self.cfg.min_devices)
                self._progress("waiting", self.engine.completed, {"online": n, "needed": self.cfg.min_devices})
                announced = n
            if time.time() > deadline:
                raise TimeoutError(f"only {n}/{self.cfg.min_devices} devices joined in {self.cfg.start_timeout_s} s")
            self._pump(0.5)

    @property
    def duplicates(self) -> int:
        """Exact repeats of signed stats messages ignored (QoS 1 redeliveries, replays)."""
        return self.verification.duplicates if self.verification is not None else 0

    # ------------------------------------------------------------------ incoming
    def _pump(self, timeout: float, wait: bool = True) -> None:
        """Handle every message already queued, waiting up to ``timeout`` for the first.
        They are handled in batches (:data:`BATCH_MESSAGES`, :data:`BATCH_S`; while a round
        is open and ``wait``, a batch waits for more messages: :meth:`_handle_batch`), each batch's
        store writes in one transaction (group commit) and its messages acknowledged to the
        broker after it commits: killed at any instant, the aggregator has stored all of a
        batch or none of it, and the broker redelivers what it did not acknowledge.

        Raises:
            StoreError: the store's leader lock was lost (checked every
                :data:`LEADER_CHECK_S` s): a standby may lead now, so this one stops; or a
                batch's transaction failed (nothing of it acknowledged).
        """
        now = time.monotonic()
        if now - self._leader_checked >= LEADER_CHECK_S:
            self._leader_checked = now
            if not self.store.leader_alive():
                raise StoreError(f"lost the leader lock of store {redact_url(self.cfg.store)}; stopping so that "
                                 "a standby leads alone")
        if self.engine.coordinator is not None and now - self._synced >= REFRESH_S:
            self._synced = now
            self.engine.sync()  # what the workers took
        m = self.transport.get(timeout)
        self._pumped = time.monotonic()
        while m is not None:
            self._batch_progress = []
            try:
                with self.store.transaction():  # group commit: one commit for the batch
                    batch, _ = self._handle_batch(m, time.monotonic() + BATCH_S,
                                                  wait=wait and self.engine.current is not None)
                    self._save_chunks()
                    self.engine.end_batch()  # a streaming round: its new sums, markers and unfolded updates
            finally:
                told, self._batch_progress = self._batch_progress, None
            for done in batch:  # only now: a crash before the commit makes the broker redeliver them
                self.transport.ack(done)
            for event in told:  # "accepted" is said of what is stored
                self._progress(*event)
            m = self.transport.get(0)
        if self.near_miss is not None:
            self.near_miss.poll()  # hellos of other federations: a mistyped name is told "did you mean"
        self._reject_log.flush()  # the summary of suppressed rejection lines, once a minute
        self.activity.flush()  # the last of a burst of events

    def _handle_batch(self, first: Incoming, end: float, admit: Callable[[Incoming], bool] | None = None,
                      wait: bool = False) -> tuple[list[Incoming], Incoming | None]:
        """Handle ``first`` and the messages queued after it, at most :data:`BATCH_MESSAGES`
        and until ``end`` (monotonic seconds), inside the caller's store transaction (group
        commit: the caller acknowledges them once it commits). Without ``wait`` the batch
        ends at the first moment the queue is empty; with it, it waits for more until ``end``
        (a round's uploads: under a steady stream a batch then holds :data:`BATCH_S` of it,
        not the one or two messages queued at an instant, so the round's sums are written
        once for several updates instead of each update's payload). With ``admit``, the
        batch goes on only while ``admit`` accepts its messages, ``first`` included.
        Returns the handled messages and the next one taken off the queue that ``admit``
        refused (not handled), or None. Raises what :meth:`_handle` raises (StoreError)."""
        batch = [first]
        self._handle(first.topic, first.payload, first.properties)
        if admit is not None and not admit(first):
            return batch, None
        while len(batch) < BATCH_MESSAGES:
            left = end - time.monotonic()
            if left <= 0:
                break
            m = self.transport.get(left if wait else 0)
            if m is None:
                break
            if admit is not None and not admit(m):
                return batch, m
            self._handle(m.topic, m.payload, m.properties)
            batch.append(m)
        return batch, None

    def _pump_between_sends(self) -> None:
        """Take in what devices sent while a round's assignments go out, in full batches
        (:data:`BATCH_MESSAGES` waiting, or :data:`BATCH_S` since the last): one commit per
        message would cost more than the sending it interleaves with."""
        if self.store.in_transaction:
            return
        if self.transport.inbox.qsize() >= BATCH_MESSAGES or time.monotonic() - self._pumped >= BATCH_S:
            self._pump(0, wait=False)

    def _handle(self, topic: str, payload: bytes, props: dict[str, str] | None = None) -> None:
        """Validate one incoming message and hand it to the registry or the round engine.

        Never raises for bad input: it is rejected with a reply (see the module docstring).
        Junk is refused cheaply, in this order, before its payload is parsed: malformed
        topics (no reply); with signatures, devices that are not provisioned (no reply) and
        update/stats messages without signature properties; oversize payloads (a reply's
        round and upload id come from a bounded scan, :func:`refers_to`). Replies and log
        lines are rate-limited (:meth:`_reject`).
        """
        if len(topic) > self._max_topic:
            self._drop("topic too long", "ignored message on a topic of %d characters: %s", len(topic), clip(topic))
            return
        try:
            device_id, direction, kind = self.topics.parse_device_topic(topic)
        except ValueError as e:
            self._drop("malformed topic", "ignored message on %s: %s", clip(topic), clip(str(e), 200))
            return
        if direction != "up":
            return
        if self.registry.get(device_id) is not None:  # ids that never registered are not kept
            self.activity.seen(device_id)
        if self.verification is not None:
            if not self.verification.knows(device_id):
                self._drop(f"{kind} from a device that is not provisioned",
                           "ignored %s from %s: not a provisioned device", kind, device_id)
                return
            unsigned = self.verification.unsigned(kind, props)
            if unsigned:  # the capped reply tells a misconfigured device why
                self.dropped += 1
                self._refuse(device_id, kind, payload, f"{kind} rejected: {unsigned}")
                return
        limit = self.cfg.max_update_bytes + 8 + MAX_HEADER if kind == "update" else MAX_CONTROL_BYTES
        if len(payload) > limit:
            self.dropped += 1
            self._refuse(device_id, kind, payload[:8 + MAX_HEADER] if kind == "update" else b"",
                         f"{kind} rejected: payload of {len(payload)} bytes exceeds {limit}")
            return
        try:
            if kind == "status":
                if not payload:
                    return
                msg = parse_message(payload, Status)
                self._same_device(device_id, msg.device_id)
                self.registry.set_online(device_id, msg.state == "online")
                return
            if kind == "hello":
                if not payload:
                    return
                msg = parse_message(payload, Hello)
                self._same_device(device_id, msg.device_id)
                if msg.task not in self.model.tasks:  # refused, not registered: it never counts as online
                    if self.registry.get(device_id) is not None:  # known under another task: not selected now
                        self.registry.set_online(device_id, False)
                    raise MessageError(f"unknown task {msg.task!r}; this federation trains {sorted(self.model.tasks)}")
                self.registry.register(msg)
                self.activity.seen(device_id)
                self._tell(device_id, Command(command="registered"))  # minor 10: the device knows it was heard
                return
            # a worker takes uploads only, and the round it reads says whether the device may send them
            if self.ingest is None and self.registry.get(device_id) is None:
                raise MessageError(f"unknown device {device_id!r}: send hello first")
            if kind == "update":
                if all(f.accept_chunk(device_id, payload, props or {}) for f in self.filters):
                    if self.ingest is not None:
                        self.ingest.on_chunk(device_id, payload, own=self._own_partition(topic))
                    else:
                        self._on_chunk(device_id, payload)
            elif kind == "stats":
                msg = parse_message(payload, Stats)
                self._same_device(device_id, msg.device_id)
                if all(f.accept_stats(device_id, payload, msg, props or {}) for f in self.filters):
                    (self.ingest.on_stats if self.ingest is not None else self.engine.on_stats)(device_id, msg)
            elif kind == "ack":
                msg = parse_message(payload, Ack)
                self._same_device(device_id, msg.device_id)
                self.engine.on_ack(device_id, msg)
        except (MessageError, ChunkError, SignatureError) as e:
            self._refuse(device_id, kind, payload, f"{kind} rejected: {e}")
        except Exception as e:  # a bug must not take the service down; the message is dropped
            if self.ingest is not None and isinstance(e, StoreError):
                raise  # a worker stops unacknowledged: the broker gives the message to it again
            self.internal_errors += 1
            self._reject_log.log(f"internal error on {kind}", logging.ERROR, "internal error handling %s from %s",
                                 kind, device_id, exc_info=True)
            self._refuse(device_id, kind, payload, f"{kind} rejected: internal error ({type(e).__name__})")

    def _on_chunk(self, device_id: str, payload: bytes) -> None:
        """An update chunk (checks passed): reassembled; a complete update goes to the engine.
        Raises ChunkError."""
        blob = self.updates.add(device_id, payload)
        if blob is not None:
            self._forget_chunks(device_id, blob.header.round, blob.header.id)
            self.engine.on_update(device_id, blob)
        else:
            self._keep_chunk(device_id, payload)

    # Chunks of an incomplete update are acknowledged to the broker, so they are kept in
    # the store until the update completes: a restarted aggregator reloads them. They are
    # written only when the batch of messages they came in ends (:meth:`_save_chunks`, before
    # the batch is committed and acknowledged): the chunks of an update that completes in the
    # same batch never reach the store. The keys kept are remembered (``_kept``), so a
    # completed update deletes exactly those, and one that kept none costs no query.
    def _keep_chunk(self, device_id: str, payload: bytes) -> None:
        header, _ = parse_chunk(payload, self.cfg.max_update_bytes, verify=False)
        if self.updates.progress(device_id, header.round, header.id)[0] and header.n > 1:
            key = f"chunks/{header.round}/{device_id}/{header.id}/{header.seq}"
            kept = self._kept.setdefault((device_id, header.round, header.id), set())
            if key not in kept:  # a redelivery of a kept chunk is stored already, or will be
                kept.add(key)
                self._unsaved[key] = payload

    def _save_chunks(self) -> None:
        """Write the kept chunks not yet in the store (end of a batch). Raises StoreError."""
        for key, payload in self._unsaved.items():
            self.store.put_blob(key, payload)
        self._unsaved.clear()

    def _forget_chunks(self, device_id: str, round_: int, transfer_id: str) -> None:
        keys = self._kept.pop((device_id, round_, transfer_id), set())
        stored = [k for k in keys if self._unsaved.pop(k, None) is None]
        if stored:
            with self.store.transaction():
                for key in stored:
                    self.store.delete(key)

    def _reload_chunks(self) -> None:
        """Feed the chunks of incomplete updates kept in the store back into reassembly."""
        for key in self.store.blob_keys("chunks/"):
            _, rnd, device_id, transfer_id, _ = key.split("/", 4)
            if self.engine.current is None or int(rnd) != self.engine.current.number:
                self.store.delete(key)
                continue
            try:
                self.updates.add(device_id, self.store.get_blob(key))
                self._kept.setdefault((device_id, int(rnd), transfer_id), set()).add(key)
            except ChunkError as e:
                log.warning("dropped stored chunk %s: %s", key, e)

    @staticmethod
    def _same_device(topic_id: str, msg_id: str) -> None:
        if topic_id != msg_id:
            raise MessageError(f"device id {msg_id!r} in the message does not match the topic's {topic_id!r}")


REFERS_SCAN_BYTES = 4096
"""Bytes of a refused payload :func:`refers_to` looks at (a chunk header, or the head of a
control message's JSON): a flood of large junk costs one bounded scan each."""
_ROUND_RE = re.compile(rb'"round"\s*:\s*(\d{1,19})(?![\d.eE])')
_TRANSFER_RE = re.compile(rb'"transfer_id"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')


SHUTDOWN_REASON = "aggregator shutting down"
"""The ``reason`` of the ``stop`` an aggregator sends its devices when it is stopped (a signal)."""


def refers_to(kind: str, payload: bytes) -> tuple[int | None, str | None]:
    """(round, upload id) a refused message shows, for the reply: a chunk's JSON header for
    ``update`` (its ``round`` and ``id``); for a control message the first ``"round"``
    and ``"transfer_id"`` members found in its first :data:`REFERS_SCAN_BYTES` bytes (a
    scan, not a parse: the message failed its checks). None where the bytes show none.
    Never raises."""
    try:
        if kind == "update":
            if payload[:4] != MAGIC or len(payload) < 8:
                return None, None
            (hlen,) = struct.unpack(">I", payload[4:8])
            obj = json.loads(payload[8:8 + hlen]) if hlen <= MAX_HEADER else None
            r, ids = (obj.get("round"), obj.get("id")) if isinstance(obj, dict) else (None, None)
        else:
            head = payload[:REFERS_SCAN_BYTES]
            m, t = _ROUND_RE.search(head), _TRANSFER_RE.search(head)
            r, ids = int(m.group(1)) if m else None, t.group(1).decode() if t else None
        round_ = r if isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_INT else None
        try:  # the id rule of topic levels and transfer ids
            return round_, check_id(ids) if isinstance(ids, str) else None
        except ValueError:
            return round_, None
    except (ValueError, UnicodeDecodeError, RecursionError, struct.error):
        return None, None


def build_strategy(config: AggregatorConfig, setup: Setup, defences: Defences) -> Strategy:
    """The configured federated method (``config.strategy``) for ``setup``, its aggregation
    part wrapped by ``defences`` (:meth:`cloud.robust.defences.Defences.wrap`: the robust
    rule, or DP-FedAvg in its place); the round engine takes it as given. A method that
    aggregates by itself keeps screening and the guard, not the robust rule (logged).

    Raises:
        ValueError: DP-FedAvg is configured but the strategy has no aggregation part to
            replace (its privacy guarantee would silently not hold).
    """
    strategy = get_strategy(config.strategy.name)(setup, **config.strategy.params)
    if strategy.aggregation is not None:
        strategy.aggregation = defences.wrap(strategy.aggregation)
    elif defences.config.dp is not None:
        raise ValueError(f"defences.dp needs a strategy with an aggregation part; {strategy.name!r} aggregates "
                         f"by itself")
    elif defences.config.robust.name != "none":
        log.warning("strategy %r aggregates by itself: the robust rule %r does not apply (screening and the "
                    "guard do)", strategy.name, defences.config.robust.name)
    return strategy


def _reason_key(reason: str, known: bool) -> str:
    """A rejection's class for rate-limited logging: the reason's first two clauses with
    quoted values and numbers blanked, and whether the device is registered; e.g.
    ``stats rejected: not valid JSON (unknown device)``."""
    return f"{reason_class(reason, 2)} ({'registered' if known else 'unknown'} device)"
