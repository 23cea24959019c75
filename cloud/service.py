"""The aggregator service: configuration, MQTT wiring, message validation, main loop.

``fedmoe aggregator --broker mqtt://HOST:PORT --config aggregator.yaml`` runs
:class:`Aggregator`. Every incoming message is validated before it reaches the round
engine (schema, topic/device-id agreement, known device, chunk checksums, size
limits); a message that fails is logged with its reason and, where a device can be
named, answered on that device's ``down/command`` topic with a ``reject``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field

from edge_sdk.data import encode_labels, load_text_file
from protocol.chunking import DEFAULT_CHUNK_BYTES, ChunkError, Reassembler
from protocol.messages import (
    Ack, Command, Hello, MessageError, ModelSpec, Progress, Stats, Status, TrainConfig, WeightFormat, encode,
    parse_message,
)
from protocol.topics import Topics
from protocol.transport import Transport, TlsConfig

from .aggregation import get_aggregation
from .assignment import get_assignment
from .global_model import GlobalModel
from .registry import Registry
from .rounds import RoundEngine, RoundSettings
from .store import Store

log = logging.getLogger(__name__)


class StrategyConfig(BaseModel):
    """A strategy by registered name, with its parameters."""

    model_config = ConfigDict(extra="forbid")
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class TaskConfig(BaseModel):
    """A task: its class labels (ids follow this order) and an optional test file."""

    model_config = ConfigDict(extra="forbid")
    labels: list[str] = Field(min_length=2)
    eval_data: str | None = None
    """CSV/JSONL ``text,label`` file the cloud evaluates the global model on."""


class AggregatorConfig(BaseModel):
    """Everything the aggregator needs; loadable from YAML (:meth:`load`)."""

    model_config = ConfigDict(extra="forbid")
    federation: str = "default"
    model: ModelSpec = Field(default_factory=ModelSpec)
    tasks: dict[str, TaskConfig]
    rounds: int = Field(10, ge=1)
    min_devices: int = Field(1, ge=1)
    """Devices that must have joined before round 1 starts."""
    start_timeout_s: float = Field(600.0, gt=0)
    """Give up if fewer than ``min_devices`` joined by then."""
    clients_per_round: float = Field(1.0, gt=0)
    quorum: float = Field(0.5, gt=0, le=1)
    round_timeout_s: float = Field(600.0, gt=0)
    assignment: StrategyConfig = Field(default_factory=lambda: StrategyConfig(name="random_moe"))
    aggregation: StrategyConfig = Field(default_factory=lambda: StrategyConfig(name="modular"))
    train: TrainConfig = Field(default_factory=TrainConfig)
    weight_format: WeightFormat = "int8"
    max_payload: int = Field(DEFAULT_CHUNK_BYTES, ge=4096)
    max_update_bytes: int = Field(256 * 1024**2, gt=0)
    store: str = "sqlite:///fedmoe-aggregator.db"
    eval_batch_size: int = Field(32, ge=1)
    eval_max_samples: int | None = Field(None, ge=1)
    seed: int = 0
    threads: int | None = None
    stop_devices_when_done: bool = True
    clear_retained_on_exit: bool = False
    """Remove the retained shard messages on exit (simulations, tests)."""
    protocol: str = "auto"
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    shared_group: str | None = None
    """Subscribe through ``$share/{group}/...`` so several workers split the load
    (MQTT 5 brokers only; chunks of one upload must then reach one worker, so use it
    with per-device routing in the broker)."""

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "AggregatorConfig":
        """Read YAML and apply top-level overrides. Raises pydantic ValidationError."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


class Aggregator:
    """The cloud side of one federation.

    Args:
        config: the aggregator config.
        broker: broker URL.
        eval_data: task -> test items (overrides each task's ``eval_data`` file).
    """

    def __init__(self, config: AggregatorConfig, broker: str,
                 eval_data: dict[str, Sequence[tuple[Any, Any]]] | None = None):
        self.cfg = config
        if config.threads:
            import torch

            torch.set_num_threads(config.threads)
        self.topics = Topics(config.federation)
        self.store = Store(config.store)
        self.registry = Registry(self.store)
        tasks = {name: t.labels for name, t in config.tasks.items()}
        self.model = GlobalModel(config.model, tasks, config.weight_format)
        self.eval_data = self._eval_sets(eval_data or {})
        tls = TlsConfig(config.tls_ca, config.tls_cert, config.tls_key) if config.tls_ca else None
        self.transport = Transport(broker, f"fedmoe-aggregator-{config.federation}", protocol=config.protocol,
                                   username=config.username, password=config.password, tls=tls,
                                   max_payload=config.max_payload)
        assignment = get_assignment(config.assignment.name)(
            self.model.layers, config.model.num_experts, seed=config.seed, **config.assignment.params)
        aggregation = get_aggregation(config.aggregation.name)(**config.aggregation.params)
        settings = RoundSettings(config.clients_per_round, config.quorum, config.round_timeout_s, config.train,
                                 config.max_update_bytes, config.eval_batch_size, config.seed)
        self.engine = RoundEngine(self.model, self.registry, self.store, assignment, aggregation, self, self.topics,
                                  settings, self.eval_data, self._reject, self._progress)
        self.engine.restore()
        self.updates = Reassembler(config.max_update_bytes)
        self.records: list[dict[str, Any]] = self.store.rounds()
        self.initial: dict[str, Any] | None = self.store.get_json("initial_evaluation")
        self._stop = threading.Event()
        self.rejected = 0

    def _eval_sets(self, given: dict[str, Sequence[tuple[Any, Any]]]) -> dict[str, list]:
        out = {}
        for name, task in self.cfg.tasks.items():
            items = given.get(name)
            if items is None and task.eval_data:
                items = load_text_file(task.eval_data).items
            if items:
                items = encode_labels(items, task.labels)
                out[name] = items[: self.cfg.eval_max_samples] if self.cfg.eval_max_samples else items
        return out

    # ------------------------------------------------------------------ Wire (for the engine)
    def publish(self, topic: str, payload: bytes) -> None:
        self.transport.publish(topic, payload)

    def publish_blob(self, topic: str, data: bytes, kind: str, round: int, transfer_id: str | None = None):
        return self.transport.publish_blob(topic, data, kind, round, transfer_id)

    @property
    def chunk_payload_bytes(self) -> int:
        return self.transport.chunk_payload_bytes

    # ------------------------------------------------------------------ replies / progress
    def _reject(self, device_id: str, round_: int | None, reason: str) -> None:
        self.rejected += 1
        log.warning("rejected message from %s (round %s): %s", device_id, round_, reason)
        try:
            msg = Command(command="reject", round=round_, reason=reason[:2000])
            self.transport.publish(self.topics.down(device_id, "command"), encode(msg))
        except Exception as e:  # the reply is best effort; the rejection stands
            log.debug("could not send reject to %s: %s", device_id, e)

    def _progress(self, event: str, round_: int, detail: dict) -> None:
        try:
            msg = Progress(event=event, round=round_, rounds=self.cfg.rounds, detail=detail)
            self.transport.publish(self.topics.progress(), encode(msg), timeout=10)
        except Exception as e:
            log.debug("progress publish failed: %s", e)

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (thread-safe)."""
        self._stop.set()

    def run(self) -> list[dict[str, Any]]:
        """Publish shards, wait for devices, run the configured rounds.

        Returns:
            All round records in the store (including earlier runs when resumed).

        Raises:
            protocol.transport.TransportError: the broker cannot be reached.
            TimeoutError: fewer than ``min_devices`` joined within ``start_timeout_s``.
        """
        self.transport.connect()
        up = self.topics.all_up()
        self.transport.subscribe(f"$share/{self.cfg.shared_group}/{up}" if self.cfg.shared_group else up)
        self._publish_shards()
        try:
            if self.initial is None:
                self.initial = self.engine.evaluate()
                self.store.put_json("initial_evaluation", self.initial)
                log.info("initial accuracy: %s", self.initial["accuracy"])
            self._wait_for_devices()
            while not self._stop.is_set() and self.engine.completed < self.cfg.rounds:
                if self.engine.current is None and not self.engine.start_round():
                    self._pump(1.0)
                    continue
                while not self._stop.is_set() and not self.engine.should_close():
                    self._pump(0.2)
                if self.engine.current is not None and not self._stop.is_set():
                    self.records.append(self.engine.close_round())
                    self.updates = Reassembler(self.cfg.max_update_bytes)
            self._progress("done", self.engine.completed, {})
            if self.cfg.stop_devices_when_done and not self._stop.is_set():
                for dev in self.registry.devices.values():
                    self.transport.publish(self.topics.down(dev.device_id, "command"), encode(Command(command="stop")))
        finally:
            if self.cfg.clear_retained_on_exit:
                self._clear_retained()
            self.transport.close()
            self.store.close()
        return self.records

    def _wait_for_devices(self) -> None:
        deadline = time.time() + self.cfg.start_timeout_s
        announced = -1
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

    def _shard_items(self):
        for sid, data in self.model.shard_bytes.items():
            prefix = self.topics.shard_prefix(self.model.version, sid)
            yield sid, prefix, data

    def _publish_shards(self) -> None:
        t0 = time.perf_counter()
        total = 0
        for sid, prefix, data in self._shard_items():
            self.transport.publish_blob(lambda i, p=prefix: f"{p}/{i}", data, "shard", self.model.version,
                                        transfer_id=f"shard-{self.model.shard_sha[sid][:32]}", retain=True)
            total += len(data)
        log.info("published %d base shards (%.1f MiB, retained) in %.1f s", len(self.model.shard_bytes),
                 total / 2**20, time.perf_counter() - t0)

    def _clear_retained(self) -> None:
        """Delete our retained shard messages (an empty retained payload clears a topic)."""
        from protocol.chunking import chunk_data_bytes

        step = chunk_data_bytes(self.transport.chunk_payload_bytes)
        items = []
        for _, prefix, data in self._shard_items():
            items += [(f"{prefix}/{i}", b"", True) for i in range(max(1, -(-len(data) // step)))]
        try:
            self.transport.publish_many(items)
        except Exception as e:
            log.warning("could not clear retained shards: %s", e)

    # ------------------------------------------------------------------ incoming
    def _pump(self, timeout: float) -> None:
        """Handle every message already queued, waiting up to ``timeout`` for the first."""
        m = self.transport.get(timeout)
        while m is not None:
            self._handle(m.topic, m.payload)
            m = self.transport.get(0)

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            device_id, direction, kind = self.topics.parse_device_topic(topic)
        except ValueError as e:
            log.warning("ignored message on %s: %s", topic, e)
            return
        if direction != "up":
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
                self.registry.register(msg)
                return
            if self.registry.get(device_id) is None:
                raise MessageError(f"unknown device {device_id!r}: send hello first")
            if kind == "update":
                blob = self.updates.add(device_id, payload)
                if blob is not None:
                    self.engine.on_update(device_id, blob)
            elif kind == "stats":
                msg = parse_message(payload, Stats)
                self._same_device(device_id, msg.device_id)
                self.engine.on_stats(device_id, msg)
            elif kind == "ack":
                msg = parse_message(payload, Ack)
                self._same_device(device_id, msg.device_id)
                self.engine.on_ack(device_id, msg)
        except (MessageError, ChunkError) as e:
            self._reject(device_id, None, f"{kind} rejected: {e}")

    @staticmethod
    def _same_device(topic_id: str, msg_id: str) -> None:
        if topic_id != msg_id:
            raise MessageError(f"device id {msg_id!r} in the message does not match the topic's {topic_id!r}")
