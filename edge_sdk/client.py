"""EdgeClient: the device side of a federation, embeddable in a device application.

One round, as the device sees it (docs/architecture.md data flow):

1. ``down/assignment`` arrives (validated): experts per layer, shard manifests, the
   reference to this round's adapter state, training config, deadline.
2. The device checks the assignment against its memory budget (:mod:`.budget`) and
   acks (or refuses, with the reason).
3. Base shards whose sha256 is not cached are fetched from their retained topics,
   verified, cached; nothing else is subscribed to, so no other shard arrives.
4. The adapter state for what it holds arrives on ``down/state`` and is checked
   against the sub-MoE's own names and shapes.
5. LoRA training on local data, validation, activation statistics.
6. ``up/update``: the trained adapter state as chunked safetensors; then
   ``up/stats``: statistics, traffic and memory figures, referencing the update.

Raw samples never leave the device.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from protocol import topics as T
from protocol.chunking import ChunkError, Reassembler
from protocol.codec import EXTRA_DTYPES, CodecError, decode_tensors, encode_tensors
from protocol.logsafe import LogLimiter, clip
from protocol.messages import (
    COMMANDS, PROTOCOL_MINOR, Ack, Assignment, Command, Hello, MessageError, Stats, Status, VersionError, encode,
    parse_message,
)
from protocol.transport import BrokerURL, Transport, TlsConfig, publish_packet_bytes

from moe_model import budget as B
from moe_model.models import get_adapter
from moe_model.quant_bnb import check_backend
from moe_model.ranks import spec_at_rank
from moe_model.shards import MAX_SHARD_BYTES, ShardCache
from moe_model.stats import ActivationStats
from moe_model.submoe import SubMoE
from moe_model.train import evaluate, train_local

from .config import DEFAULT_WEIGHT_FORMATS
from .data import encode_labels, train_val_split
from .filters import Filter, Signing, UpdateContext
from .http_shards import ShardDownloadError, download
from .objectives import check_objectives, terms_for

R = TypeVar("R")

log = logging.getLogger(__name__)
SDK_VERSION = "0.1.0"
MAX_STATE_BYTES = 512 * 1024**2


@dataclass
class RoundSummary:
    """What one round did on this device."""

    round: int
    train_loss: float
    val_accuracy: float
    bytes_up: int
    bytes_down: int
    peak_rss_bytes: int
    shards_fetched: list[str]
    experts: dict[int, list[int]]
    seconds: float
    predicted_peak_bytes: int = 0
    """The memory plan's total for the round (compare with ``peak_footprint_bytes``)."""
    weight_format: str = ""
    peak_footprint_bytes: int = 0
    """Peak footprint (anonymous + shared + swap, ``moe_model.budget.PeakMeter``): what the
    budget and the plan are held against."""


@dataclass(frozen=True)
class Notice:
    """What the cloud told this device outside a round's work (``Command`` messages).

    ``kind`` is ``excluded`` (the cloud cannot use the device in ``round``: ``reason``,
    and for memory ``budget_bytes`` / ``needed_bytes`` / ``runtime_bytes``),
    ``reject`` (a message of the device was refused: ``message`` is its kind, ``upload_id``
    the update's transfer id, where the cloud could read them) or ``round_failed`` (the
    round closed without a new global model on the cloud).
    """

    kind: str
    round: int | None
    reason: str
    budget_bytes: int | None = None
    needed_bytes: int | None = None
    runtime_bytes: int | None = None
    message: str | None = None
    upload_id: str | None = None


DEFAULT_HELLO_TIMEOUT_S = 60.0
"""Seconds a device waits for its aggregator's answer to the hello (:class:`EdgeClient`)."""

HELLO_RESEND_S = 5.0
"""Seconds after which an unanswered hello is sent again; the wait doubles after each resend
(5, 10, 20, ... s) until an answer comes or ``hello_timeout_s`` runs out. A hello can be lost
where a subscription has not yet reached every node of a broker cluster; the aggregator's
registration is idempotent."""

MAX_NOTICES = 100
"""Notices :attr:`EdgeClient.notices` keeps (the newest)."""


class RoundStopped(Exception):
    """Raised between training steps when the device must stop (:meth:`EdgeClient.stop`, or a
    ``stop`` command it will act on): the round is left unfinished and acknowledged as failed."""


@dataclass
class _Held:
    key: tuple
    model: SubMoE


MAX_HELD_STATES = 4
"""Adapter-state blobs a device keeps before their assignment uses them (the oldest goes first:
the state of a re-sent assignment that arrived after the first one was taken)."""


@dataclass
class _Inbox:
    controls: list[Any] = field(default_factory=list)
    states: dict[str, bytes] = field(default_factory=dict)
    shards: dict[str, bytes] = field(default_factory=dict)


class EdgeClient:
    """Join a federation over MQTT and train assigned sub-MoEs on local data.

    Args:
        broker: broker URL, e.g. ``mqtt://127.0.0.1:1883``.
        device_id: this device's id (also its MQTT username under an ACL).
        dataset: a sequence / torch Dataset of ``(input, label)``; ``label`` a class
            name or id of the task's label list.
        federation: federation name (topic root ``fl/v1/{federation}``).
        budget_bytes: memory budget in bytes, or a string like ``"1.5GiB"``.
        task: task name (selects the classification head).
        weight_formats: formats this device can load, preferred first.
        cache_dir: where base shards are cached by sha256.
        val_fraction: share of local data held out for validation.
        seed: local shuffling seed.
        threads: torch intra-op threads (``None`` leaves torch's default).
        protocol, username, password, tls, max_payload: MQTT settings
            (:class:`protocol.transport.Transport`).
        runtime_bytes: memory the process uses outside the model (the memory plan's
            fixed part); measured now unless given, as the footprint
            (:func:`moe_model.budget.current_footprint_bytes`: anonymous + shared +
            swapped memory, what an OS limit enforces; RSS also counts clean file pages
            the kernel drops under pressure).
        headroom_bytes: reserve added to the measured ``runtime_bytes`` and kept free
            below the plan every round (:data:`moe_model.budget.DEFAULT_HEADROOM_BYTES`
            when ``runtime_bytes`` is measured; 0 when it is given: the caller's number
            is taken as it is). See :meth:`_recalibrate`.
        low_memory: serve large allocations by mmap so freed activations return to
            the OS (:func:`moe_model.budget.tune_allocator`): about half the peak memory
            for about 35% slower steps (measured on MiniLM, see its docstring).
        signing_key: this device's Ed25519 key (base64 from ``fedmoe provision``, or a
            key object); updates and stats are then signed (:mod:`protocol.signing`,
            needs MQTT 5 for the user properties).
        cache_max: size limit of the shard cache directory (bytes or ``"2GiB"``); least
            recently used shards not needed this round are evicted beyond it.
        quant_backend: ``"torch"`` (default: dequantize per matmul, plain torch) or
            ``"bitsandbytes"`` (its int8/nf4 layers on the same shards,
            :mod:`moe_model.quant_bnb`; needs the ``quant`` extra).
        model_dir: this device's copy of an ``hf-moe`` checkpoint directory (config.json and
            tokenizer; no weights needed), used instead of the cloud's path in the assignment.
        filters: the outgoing filter chain (:mod:`edge_sdk.filters`), applied in order to
            ``hello``, the update and ``stats``; signing (with ``signing_key``) comes last.
        hello_timeout_s: seconds :meth:`run` waits for any answer of an aggregator of
            ``federation`` to the hello (``registered``, protocol minor 10, or any command or
            assignment) before it says that none answered (a mistyped federation name, no
            aggregator on this broker).
        on_no_aggregator: then ``"exit"`` (:meth:`run` returns, :attr:`exit_reason` set) or
            ``"wait"`` (log it and keep waiting).
        on_aggregator_stop: what a ``stop`` with a reason (``aggregator shutting down``: the
            aggregator was stopped, its open round kept for its restart) does: ``"exit"``, or
            ``"wait"`` for the restarted aggregator (a ``stop`` without a reason, the end of
            the federation, always ends :meth:`run`).

    The budget may be lowered while the client runs (``client.budget_bytes = ...``, e.g.
    when the device application needs memory): the next assignment that no longer fits
    is refused with the new budget, and the cloud reassigns within it.

    :meth:`from_credentials` builds a client from a provisioned credentials file.
    """

    def __init__(
        self,
        broker: str,
        device_id: str,
        dataset: Sequence[tuple[Any, Any]],
        *,
        federation: str = "default",
        budget_bytes: int | str = "1GiB",
        task: str = "default",
        weight_formats: Sequence[str] = DEFAULT_WEIGHT_FORMATS,
        cache_dir: str | Path | None = None,
        val_fraction: float = 0.2,
        seed: int = 0,
        threads: int | None = None,
        protocol: str = "auto",
        username: str | None = None,
        password: str | None = None,
        tls: TlsConfig | None = None,
        max_payload: int | None = None,
        runtime_bytes: int | None = None,
        headroom_bytes: int | None = None,
        low_memory: bool = True,
        signing_key: Any = None,
        cache_max: int | str | None = None,
        quant_backend: str = "torch",
        filters: Sequence[Filter] = (),
        model_dir: str | Path | None = None,
        hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
        on_no_aggregator: str = "exit",
        on_aggregator_stop: str = "exit",
    ):
        for name, value in (("on_no_aggregator", on_no_aggregator), ("on_aggregator_stop", on_aggregator_stop)):
            if value not in ("exit", "wait"):
                raise ValueError(f"{name} must be 'exit' or 'wait', got {value!r}")
        if not hello_timeout_s > 0:
            raise ValueError(f"hello_timeout_s must be > 0, got {hello_timeout_s}")
        self.hello_timeout_s = float(hello_timeout_s)
        self.on_no_aggregator = on_no_aggregator
        self.on_aggregator_stop = on_aggregator_stop
        self.exit_reason: str | None = None
        """Why :meth:`run` returned early, if it did for a problem (no aggregator answered, the
        hello was refused); None otherwise."""
        self._answered = False
        self._registered = False  # the first `registered` is logged; the answers to resent hellos are not
        self._hellos_sent = 0
        self.device_id = T.check_id(device_id, "device id")
        self.model_dir = None if model_dir is None else str(model_dir)
        self.topics = T.Topics(federation)
        self.budget_bytes = B.parse_bytes(budget_bytes)
        self.task = task
        self.weight_formats = list(weight_formats)
        self.raw_items = [dataset[i] for i in range(len(dataset))]
        self.val_fraction = val_fraction
        self.seed = seed
        check_backend(quant_backend)
        self.quant_backend = quant_backend
        if threads:
            torch.set_num_threads(threads)
        B.bound_native_caches()
        if low_memory:
            B.tune_allocator()
        self.cache = ShardCache(Path(cache_dir) if cache_dir else Path.home() / ".cache" / "fedmoe" / device_id,
                                B.parse_bytes(cache_max) if cache_max else None)
        status_offline = encode(Status(device_id=device_id, state="offline"))
        kw = {"max_payload": max_payload} if max_payload else {}
        self.downlink_qos = 1
        """QoS of the ``down/#`` subscription: 1 on one broker; 0 on a cluster (a broker URL
        naming several nodes), where a QoS 1 subscription costs a replicated JetStream
        consumer per device (the fleet benchmark's 3-node NATS cluster did not carry 1,000
        devices that way, and did with QoS 0: docs/deployment.md); the cloud re-sends an
        assignment that was not acknowledged (``assignment_resend_s``) and the device takes
        a re-sent state (PROTOCOL.md §4.2)."""
        if len(BrokerURL.parse_nodes(broker)) > 1:  # a cluster: keep the session (down/#) when moving nodes
            kw.update(clean_start="first_only", session_expiry_s=3600)
            self.downlink_qos = 0
        self.transport = Transport(
            broker, f"dev-{device_id}", protocol=protocol, username=username or device_id, password=password,
            tls=tls, will=(self.topics.up(device_id, "status"), status_offline), **kw,
        )
        if headroom_bytes is None:
            headroom_bytes = B.DEFAULT_HEADROOM_BYTES if runtime_bytes is None else 0
        if headroom_bytes < 0:
            raise ValueError(f"headroom_bytes must be >= 0, got {headroom_bytes}")
        if runtime_bytes is None:
            B.release_free_memory()
            runtime_bytes = B.current_footprint_bytes() or B.DEFAULT_RUNTIME_BYTES
        self.headroom_bytes = int(headroom_bytes)
        self.runtime_bytes = runtime_bytes + self.headroom_bytes
        """The plan's fixed part as reported in ``hello`` and ``stats``: the measured
        baseline, the headroom, and every later recalibration."""
        self.filters: list[Filter] = list(filters)
        """The outgoing filter chain (:mod:`edge_sdk.filters`), signing last."""
        if signing_key is not None:
            from protocol.signing import Signer, load_private_key

            key = load_private_key(signing_key) if isinstance(signing_key, str) else signing_key
            self.filters.append(Signing(Signer(self.device_id, key)))
        self.transport.birth = (self.topics.up(device_id, "status"),
                                encode(Status(device_id=device_id, state="online")))
        self.history: list[RoundSummary] = []
        self.notices: list[Notice] = []
        """What the cloud said besides assignments, newest last (:class:`Notice`): why the
        device was left out of a round, rejected messages, failed rounds."""
        self._inbox = _Inbox()
        self._shard_rx = Reassembler(MAX_SHARD_BYTES)
        self._state_rx = Reassembler(MAX_STATE_BYTES)
        self._reject_log = LogLimiter(log, "rejected messages", per_key=3, total=10, interval_s=60.0)
        self._version_log = LogLimiter(log, "messages of another protocol version", per_key=1, total=5,
                                       interval_s=3600.0, summary_level=logging.DEBUG)
        """Bad messages on the downlink are logged rate-limited (a stranger may flood them)."""
        self._decoded: dict[str, dict[str, torch.Tensor]] = {}
        self._held: _Held | None = None
        self._term_memory: dict[str, dict] = {}
        """The objective terms' memory across rounds (:attr:`TermContext.memory`)."""
        self._data_cache: tuple[tuple[str, ...], list, list] | None = None
        self._last_round = (-1, -1)
        self._mark = (0, 0)
        self._blob_bytes_received = 0
        self._blob_mark = 0
        """Reassembled tensor-blob bytes received (base shards, adapter state): the payload
        of ``transport.bytes_received``."""
        self._stop = False

    @classmethod
    def from_credentials(cls, broker: str, credentials: str | Path, dataset: Sequence[tuple[Any, Any]],
                         **kwargs: Any) -> "EdgeClient":
        """A client from a ``fedmoe provision`` credentials file (device id, username,
        password, signing key, CA file); ``kwargs`` as for the constructor.

        Raises:
            ValueError: the file is unreadable or lacks a field.
        """
        from protocol.credentials import load_credentials

        info = load_credentials(credentials)
        if "device_id" not in info or "signing_key" not in info:
            raise ValueError(f"{credentials} is not a device credentials file")
        if info.get("tls_ca") and kwargs.get("tls") is None and broker.startswith(("mqtts", "ssl")):
            kwargs["tls"] = TlsConfig(info["tls_ca"])
        return cls(broker, info["device_id"], dataset, username=info["username"], password=info.get("password"),
                   signing_key=info["signing_key"], **kwargs)

    # ------------------------------------------------------------------ lifecycle
    def run(self, max_rounds: int | None = None, idle_timeout: float | None = None) -> list[RoundSummary]:
        """Connect, announce, and serve rounds until told to stop.

        Args:
            max_rounds: return after this many rounds (None: until a ``stop`` command).
            idle_timeout: return if no assignment arrives for this many seconds.

        Returns:
            The summaries of the rounds this device trained.

        Raises:
            protocol.transport.TransportError: the broker cannot be reached.
            ValueError: the budget cannot hold even this device's runtime baseline
                (:meth:`check_budget`), before anything is sent.
        """
        self.check_budget()
        self.transport.connect()
        self.transport.subscribe(self.topics.device_down(self.device_id), qos=self.downlink_qos)
        status = encode(Status(device_id=self.device_id, state="online"))
        self.transport.publish(self.topics.up(self.device_id, "status"), status, retain=True)
        hello = Hello(
            device_id=self.device_id, sdk_version=SDK_VERSION, budget_bytes=self.budget_bytes,
            weight_formats=self.weight_formats, num_samples=len(self.raw_items), task=self.task,
            runtime_bytes=self.runtime_bytes, protocol_minor=PROTOCOL_MINOR,
        )
        for f in self.filters:
            hello = f.on_hello(hello)
        payload = encode(hello)

        def send_hello() -> None:
            self._publish("hello", 0, lambda: self.transport.publish(self.topics.up(self.device_id, "hello"),
                                                                     payload, retain=True))
            self._hellos_sent += 1

        send_hello()
        log.info("%s joined %s (budget %.2f GiB, %d samples, task %s)", self.device_id, self.topics.federation,
                 self.budget_bytes / 1024**3, len(self.raw_items), self.task)
        self._mark = (self.transport.bytes_sent, self.transport.bytes_received)
        last_activity = joined = time.monotonic()
        told = False
        resend_every = HELLO_RESEND_S
        resend_at = joined + resend_every
        try:
            while not self._stop and (max_rounds is None or len(self.history) < max_rounds):
                msg = self._next_control(timeout=1.0)
                if msg is None:
                    if not self._answered and not told and time.monotonic() >= resend_at:
                        log.info("%s: no answer to the hello after %.0f s; sending it again", self.device_id,
                                 time.monotonic() - joined)
                        send_hello()
                        resend_every *= 2
                        resend_at = time.monotonic() + resend_every
                    if not self._answered and not told and time.monotonic() - joined > self.hello_timeout_s:
                        told = True
                        why = (f"no aggregator of federation {self.topics.federation!r} answered the hello "
                               f"within {self.hello_timeout_s:.0f} s (is the federation name right? does its "
                               f"aggregator run on this broker?)")
                        if self.on_no_aggregator == "exit":
                            log.error("%s: %s; leaving (on_no_aggregator: exit)", self.device_id, why)
                            self.exit_reason = why
                            break
                        log.warning("%s: %s; waiting (on_no_aggregator: wait)", self.device_id, why)
                    if idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                        log.info("%s: no assignment for %.0f s; leaving", self.device_id, idle_timeout)
                        break
                    continue
                last_activity = time.monotonic()
                if not self._near_miss(msg):  # another federation's aggregator is not this one's answer
                    self._answered = True  # any message of the cloud (older than minor 10: no `registered`)
                if isinstance(msg, Command):
                    self._on_command(msg)
                elif isinstance(msg, Assignment):
                    self._serve(msg)
        finally:
            self.close()
        return self.history

    def _on_command(self, msg: Command) -> None:
        """``stop`` ends :meth:`run`; ``reject``, ``excluded`` and ``round_failed`` are
        logged and kept in :attr:`notices`; commands of a newer minor version are ignored.
        A ``reject`` of this device's hello for its task (``unknown task``) ends :meth:`run`
        with :attr:`exit_reason` set, and so does one for its federation (``unknown
        federation``: the aggregator of a similar name) when no aggregator of its own
        answered, the hello was sent again and ``on_no_aggregator`` is ``exit``."""
        if msg.command == "stop":
            if msg.reason and self.on_aggregator_stop == "wait":
                log.warning("%s: the aggregator stopped (%s); waiting for it to come back (on_aggregator_stop: "
                            "wait)", self.device_id, msg.reason)
                return
            log.info("%s: stop command received%s; leaving", self.device_id, f" ({msg.reason})" if msg.reason else "")
            self._stop = True
            return
        if msg.command == "registered":  # one per hello sent: the resends of a slow answer bring several
            if not self._registered:
                log.info("%s: registered with the aggregator of %s", self.device_id, self.topics.federation)
            self._registered = True
            return
        if msg.command not in COMMANDS:
            log.debug("%s: ignoring unknown command %r (newer protocol minor version)", self.device_id, msg.command)
            return
        what = {"reject": "the cloud rejected a message of round %s: %s",
                "excluded": "the cloud cannot use this device in round %s: %s",
                "round_failed": "round %s closed without a new global model: %s"}[msg.command]
        refers = "".join(f" [{k} {v}]" for k, v in (("kind", msg.kind), ("upload", msg.upload_id)) if v)
        log.warning("%s: " + what + "%s", self.device_id, msg.round, msg.reason, refers)
        self.notices.append(Notice(msg.command, msg.round, msg.reason or "", msg.budget_bytes, msg.needed_bytes,
                                   msg.runtime_bytes, msg.kind, msg.upload_id))
        del self.notices[:-MAX_NOTICES]
        # a refused hello of this device (its task is not trained here): waiting would be in vain. Any
        # other hello reject (junk someone sent on this device's topic: not JSON, not an object) is
        # only logged above, so a stranger's flood cannot make the device leave.
        if msg.command == "reject" and msg.kind == "hello" and f"unknown task {self.task!r}" in (msg.reason or ""):
            self.exit_reason = f"the aggregator refused this device's hello: {msg.reason}"
            log.error("%s: %s; leaving", self.device_id, self.exit_reason)
            self._stop = True
        elif self._near_miss(msg):
            # the aggregator of a federation with a similar name (cloud.near_miss): a mistyped federation
            # name, unless this device's own aggregator answered, or the hello was not yet sent again
            # (a restart whose first hello the other aggregator took for one sent again)
            if self._answered or self._hellos_sent < 2 or self.on_no_aggregator == "wait":
                log.info("%s: not leaving on that (%s)", self.device_id,
                         "this federation's aggregator answered" if self._answered else
                         "on_no_aggregator: wait" if self.on_no_aggregator == "wait" else "the hello was just sent")
                return
            self.exit_reason = f"no aggregator of federation {self.topics.federation!r} answered, and the " \
                               f"aggregator of another federation refused this device's hello: {msg.reason}"
            log.error("%s: %s; leaving", self.device_id, self.exit_reason)
            self._stop = True

    def _near_miss(self, msg: Command | Assignment) -> bool:
        """Whether ``msg`` is the reject an aggregator of a near-miss federation sends a hello
        it sees sent again (``hello rejected: unknown federation '<this device's federation>'
        on this broker; did you mean ...``, PROTOCOL.md §9)."""
        return isinstance(msg, Command) and msg.command == "reject" and msg.kind == "hello" and \
            f"unknown federation {self.topics.federation!r}" in (msg.reason or "")

    def check_budget(self) -> None:
        """Check, before joining, that the budget can hold more than this device's own runtime
        baseline (``runtime_bytes``: the measured footprint plus the headroom, the memory
        plan's fixed part, :func:`moe_model.budget.estimate`): below it not even one expert
        per layer fits, and no aggregator could ever assign the device anything.

        Raises:
            ValueError: the one-line reason, with both figures in MiB.
        """
        if self.budget_bytes <= self.runtime_bytes:
            raise ValueError(
                f"budget {self.budget_bytes / 2**20:.0f} MiB is below this device's runtime baseline of "
                f"{self.runtime_bytes / 2**20:.0f} MiB (measured footprint + {self.headroom_bytes / 2**20:.0f} MiB "
                f"headroom): not even one expert per layer fits; give a larger budget")

    def stop(self) -> None:
        """Ask ``run()`` to return within about a second; a round in training is left after
        its current step (and acknowledged as failed). Safe to call from another thread, and
        before or after ``run()``."""
        self._stop = True

    def close(self) -> None:
        """Publish ``offline`` and disconnect."""
        if self.transport.connected:
            try:
                status = encode(Status(device_id=self.device_id, state="offline"))
                self.transport.publish(self.topics.up(self.device_id, "status"), status, retain=True, timeout=5)
            except Exception as e:  # best effort on the way out
                log.debug("could not publish offline status: %s", e)
        self.transport.close()

    # ------------------------------------------------------------------ message pump
    def _pump(self, timeout: float) -> bool:
        """Handle one incoming message; False if none arrived within ``timeout``."""
        self._reject_log.flush()  # the summary of suppressed lines, once a minute
        m = self.transport.get(timeout)
        if m is None:
            return False
        shard_root = f"{self.topics.root}/shards/"
        try:
            if m.topic.startswith(shard_root):
                blob = self._shard_rx.add("cloud", m.payload)
                if blob is not None:
                    self._inbox.shards[blob.header.sha] = blob.data
                    self._blob_bytes_received += len(blob.data)
                return True
            _, _, kind = self.topics.parse_device_topic(m.topic)
            if kind == "state":
                blob = self._state_rx.add("cloud", m.payload)
                if blob is not None:
                    self._inbox.states[blob.transfer_id] = blob.data
                    self._blob_bytes_received += len(blob.data)
                    while len(self._inbox.states) > MAX_HELD_STATES:  # re-sent states nobody took
                        self._inbox.states.pop(next(iter(self._inbox.states)))
            elif kind in ("assignment", "command"):
                self._inbox.controls.append(parse_message(m.payload, Assignment if kind == "assignment" else Command))
        except VersionError as e:  # another major version: say so once per (kind, version) and minute
            self._version_log.log(f"{kind} of protocol version {e.version}", logging.ERROR,
                                 "%s: cannot read the cloud's %s messages: %s; device SDK and cloud must share the "
                                 "major version", self.device_id, kind, e)
        except (ChunkError, MessageError, ValueError) as e:
            where = "shard" if m.topic.startswith(shard_root) else "device"
            self._reject_log.log(f"{type(e).__name__} on a {where} topic", logging.WARNING,
                                 "%s: rejected message on %s: %s", self.device_id, clip(m.topic), clip(str(e), 300))
        return True

    def _check_stop(self) -> None:
        """Between training steps: take in what arrived (a ``stop`` from the cloud stays
        queued for :meth:`run`) and raise :class:`RoundStopped` when this device was asked to
        stop (:meth:`stop`, a signal) or the aggregator said it stops and
        ``on_aggregator_stop`` is ``exit``: training on would only delay leaving."""
        while self._pump(0):
            pass
        for msg in self._inbox.controls:
            if isinstance(msg, Command) and msg.command == "stop" and not (
                    msg.reason and self.on_aggregator_stop == "wait"):
                raise RoundStopped(f"stop command received{f' ({msg.reason})' if msg.reason else ''}")
        if self._stop:
            raise RoundStopped("asked to stop")

    def _next_control(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._inbox.controls:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._pump(left)
        return self._inbox.controls.pop(0)

    def _wait(self, done, deadline: float, what: str) -> None:
        while not done():
            if time.time() > deadline:
                raise TimeoutError(f"{what} did not arrive before the round deadline")
            self._pump(0.5)

    # ------------------------------------------------------------------ one round
    def _serve(self, a: Assignment) -> None:
        if (a.round, a.attempt) <= self._last_round:
            log.info("%s: ignoring stale assignment for round %d", self.device_id, a.round)
            self._inbox.states.pop(a.state.transfer_id, None)
            return
        self._last_round = (a.round, a.attempt)
        try:
            self._train_round(a)
        except RoundStopped as e:  # the cloud goes away or this device is stopped: the round is not finished
            log.info("%s: round %d left unfinished: %s", self.device_id, a.round, e)
            self._ack(a.round, False, f"device stopping: {e}", attempt=a.attempt)
        except (TimeoutError, CodecError, KeyError, ValueError) as e:
            log.error("%s: round %d failed: %s", self.device_id, a.round, e)
            self._ack(a.round, False, f"round failed on device: {e}", attempt=a.attempt)
        except Exception as e:  # keep serving later rounds; the cloud counts this one as failed
            log.exception("%s: round %d failed unexpectedly", self.device_id, a.round)
            self._ack(a.round, False, f"round failed on device: {type(e).__name__}: {e}", attempt=a.attempt)

    def _ack(self, rnd: int, accepted: bool, reason: str | None = None, **extra: Any) -> None:
        # an exception's text can be any length; the ack's reason may hold 1000 characters
        msg = Ack(device_id=self.device_id, round=rnd, accepted=accepted,
                  reason=None if reason is None else reason[:1000], **extra)
        self.transport.publish(self.topics.up(self.device_id, "ack"), encode(msg))

    def _await_state(self, a: Assignment) -> bytes:
        """The adapter-state blob of assignment ``a``, once it arrived: the one ``a`` names or
        that of a re-sent copy of ``a`` (same round and attempt, a new state transfer: the
        cloud re-sends an assignment it got no ack for, since on a QoS 0 downlink the first
        state may be lost). Raises TimeoutError at ``a.deadline``."""
        ids = [a.state.transfer_id]

        def arrived() -> bool:
            for c in self._inbox.controls:
                if isinstance(c, Assignment) and (c.round, c.attempt) == (a.round, a.attempt) \
                        and c.state.transfer_id not in ids:
                    ids.append(c.state.transfer_id)
            return any(i in self._inbox.states for i in ids)

        self._wait(arrived, a.deadline, "adapter state")
        found = next(i for i in ids if i in self._inbox.states)
        for i in ids:
            if i != found:
                self._inbox.states.pop(i, None)
        return self._inbox.states.pop(found)

    def _train_round(self, a: Assignment) -> None:
        t0 = time.perf_counter()
        if self.model_dir is not None and a.model.family == "hf-moe":  # this device's copy of config + tokenizer
            a = a.model_copy(update={"model": a.model.model_copy(update={"base": self.model_dir, "tokenizer": None})})
        if a.lora_rank is not None:  # (minor 13) train a lower LoRA rank: the first columns of each B
            a = a.model_copy(update={"model": spec_at_rank(a.model, a.lora_rank)})
        meter = B.PeakMeter().start()
        labels = list(a.labels)
        plan = B.estimate(a.model, a.experts, a.train.batch_size, len(labels), self.runtime_bytes, a.weight_format)
        if plan.total > self.budget_bytes:
            reason = (f"over budget: the memory plan needs {plan.total / 2**20:.0f} MiB "
                      f"({a.weight_format}, {plan.experts} experts), budget is {self.budget_bytes / 2**20:.0f} MiB")
            log.warning("%s: refusing round %d: %s", self.device_id, a.round, reason)
            self._ack(a.round, False, reason, attempt=a.attempt, budget_bytes=self.budget_bytes,
                      runtime_bytes=self.runtime_bytes, needed_bytes=plan.total)
            return
        try:
            check_objectives(a.objectives)
        except ValueError as e:
            log.warning("%s: refusing round %d: %s", self.device_id, a.round, e)
            self._ack(a.round, False, str(e)[:1000], attempt=a.attempt)
            return
        state_bytes = self._await_state(a)
        self._ack(a.round, True, attempt=a.attempt)  # only now: the cloud re-sends what was not acknowledged
        train_items, val_items = self._local_data(labels)

        fetched = self._fetch_shards(a)
        model = self._model_for(a, len(labels))
        B.release_free_memory()
        meter.mark()
        extra = {name: (tuple(t.shape), EXTRA_DTYPES[t.dtype]) for name, t in a.tensors.items()}
        state = decode_tensors(state_bytes, MAX_STATE_BYTES, {**model.expected(), **extra}, as_float=torch.float32)
        del state_bytes
        tensors = {name: state.pop(name) for name in extra}
        model.load_adapter_state(state)
        terms = terms_for(a.train, a.objectives, state, tensors, self._term_memory, val_items)
        for t in terms:
            t.before_training(model)

        stats = ActivationStats(model.model.moe_blocks(), a.model.num_experts, hidden=a.train.collect_hidden)
        result = train_local(model, train_items, a.train, terms=[t for t in terms if t.adds_loss], stats=stats,
                             seed=self.seed * 100_003 + a.round, progress=lambda *x: (meter.mark(), self._check_stop()),
                             name=f"{self.device_id} round {a.round}")
        extras = {f"{t.name}.{k}": [float(x) for x in v] for t in terms for k, v in t.statistics().items()}
        # at the training batch size, which the memory plan covers (a causal LM's (B, T, vocab) logits at
        # evaluate's default batch of 32 took 2.1 GiB where the plan said 1.6 GiB)
        val = evaluate(model, val_items, a.train.batch_size, stats=stats) if val_items else None
        log.info("%s round %d: %d steps, loss %.4f, val acc %s (%.1f s)", self.device_id, a.round, result.steps,
                 result.loss, f"{val.accuracy:.3f}" if val else "n/a", result.seconds)

        for t in terms:
            t.after_training(model)
        tensors = model.adapter_state()
        ctx = UpdateContext(a, model, state, train_items, work_dir=self.cache.directory / "filters" / self.device_id)
        for f in self.filters:
            tensors = f.on_update(tensors, ctx)
        update = encode_tensors(tensors, ctx.format, ctx.metadata, vectors=ctx.vectors, compress=ctx.compress)
        upload_id = uuid.uuid4().hex[:16]
        props = self._properties("update", a.round, upload_id, update)
        ref = self._publish("update", a.round, lambda: self.transport.publish_blob(
            self.topics.up(self.device_id, "update", a.uplink), update, "update", a.round, transfer_id=upload_id,
            user_properties=props))
        peak, footprint = meter.peaks()
        self._recalibrate(a.round, footprint, plan.total)
        topic = self.topics.up(self.device_id, "stats", a.uplink)
        sent0, recv0 = self._mark
        down = self.transport.bytes_received - recv0

        def build(bytes_up: int) -> bytes:
            msg = Stats(
                device_id=self.device_id, round=a.round, task=a.task, num_samples=len(train_items),
                train_loss=result.loss, val_loss=val.loss if val else None,
                val_accuracy=val.accuracy if val else None, layers=stats.layer_stats(), update=ref,
                train_seconds=result.seconds, bytes_up=bytes_up, bytes_down=down, peak_rss_bytes=peak,
                peak_footprint_bytes=footprint, baseline_rss_bytes=self.runtime_bytes, shards_fetched=fetched,
                predicted_peak_bytes=plan.total,
                weight_format=a.weight_format, payload_up=len(update),
                payload_down=self._blob_bytes_received - self._blob_mark, extras=extras,
            )
            for f in self.filters:
                msg = f.on_stats(msg)
            return encode(msg)

        up_before = self.transport.bytes_sent - sent0
        payload, up = build(up_before), up_before
        for _ in range(8):  # bytes_up includes this very message: iterate to the fixed point
            total = up_before + publish_packet_bytes(topic, len(payload), 1, self.transport.v5)
            if total == up:
                break
            up, payload = total, build(total)
        props = self._properties("stats", a.round, upload_id, payload)
        self._publish("stats", a.round, lambda: self.transport.publish(topic, payload, user_properties=props))
        self._mark = (self.transport.bytes_sent, self.transport.bytes_received)
        self._blob_mark = self._blob_bytes_received
        B.release_free_memory()
        self.history.append(RoundSummary(
            a.round, result.loss, val.accuracy if val else float("nan"), up, down, peak, fetched,
            {k: list(v) for k, v in a.experts.items()}, time.perf_counter() - t0, plan.total, a.weight_format,
            footprint,
        ))

    def _publish(self, kind: str, rnd: int, send: Callable[[], R]) -> R:
        """``send()`` through every filter's :meth:`Filter.on_publish`, the first outermost."""
        for f in reversed(self.filters):
            send = functools.partial(f.on_publish, kind, rnd, send)
        return send()

    def _properties(self, kind: str, rnd: int, upload_id: str, payload: bytes) -> dict[str, str] | None:
        """The filters' MQTT user properties for the final ``payload`` (None: none)."""
        props: dict[str, str] = {}
        for f in self.filters:
            props.update(f.properties(kind, rnd, upload_id, payload))
        return props or None

    def _recalibrate(self, rnd: int, peak: int, planned: int) -> None:
        """Keep the plan honest when a round's measured peak exceeded it.

        The plan models the model's memory on top of ``runtime_bytes`` (the baseline
        measured at start-up plus ``headroom_bytes``). The headroom is a safety margin:
        a peak that stays within the plan, even one that eats into the headroom, changes
        nothing, so a device's assignment does not shrink while its budget and the plan
        stay the same. Only a peak *above* the plan (the headroom used up) raises
        ``runtime_bytes`` by the excess plus the headroom, so the next plans, here and in
        the cloud (the stats carry it as ``baseline_rss_bytes``), again keep the whole
        headroom free above what was measured. A client made with ``runtime_bytes=0``
        plans for the model alone (tests do) and is left as it is.
        """
        if peak <= planned or self.runtime_bytes <= 0:
            if peak > planned - self.headroom_bytes:
                log.info("%s round %d: peak footprint %.1f MiB is within the memory plan's %.1f MiB but used %.1f of "
                         "its %.0f MiB headroom", self.device_id, rnd, peak / 2**20, planned / 2**20,
                         (peak - planned + self.headroom_bytes) / 2**20, self.headroom_bytes / 2**20)
            return
        raise_by = peak - planned + self.headroom_bytes
        log.warning("%s round %d: peak footprint %.1f MiB exceeded the memory plan's %.1f MiB; counting %.1f MiB "
                    "more in the runtime baseline from now on", self.device_id, rnd, peak / 2**20, planned / 2**20,
                    raise_by / 2**20)
        self.runtime_bytes += raise_by

    def _local_data(self, labels: list[str]) -> tuple[list, list]:
        key = tuple(labels)
        if self._data_cache is None or self._data_cache[0] != key:
            items = encode_labels(self.raw_items, labels)
            train, val = train_val_split(items, self.val_fraction, self.seed)
            self._data_cache = (key, train, val)
        return self._data_cache[1], self._data_cache[2]

    def _fetch_shards(self, a: Assignment) -> list[str]:
        """Make every assigned shard available: in memory, else loaded from the disk
        cache, else fetched, verified and written to the cache, then loaded: from its URL
        by HTTP range requests where the manifest gives one (:mod:`edge_sdk.http_shards`),
        else from its retained topics (at most :data:`moe_model.budget.FETCH_WINDOW_BYTES`
        in flight either way). Expert linears stay in the shard's format
        (:mod:`moe_model.quant`); shards of experts not assigned are never touched.

        Returns:
            Ids of the shards downloaded from the broker this round.
        """
        fetched = []
        quantized_backbone = get_adapter(a.model.family).quantized_backbone

        def keep(shard_id: str) -> bool:  # held as stored (experts; the backbone where the family can)
            return shard_id != "backbone" or quantized_backbone

        wanted = {m.sha256 for m in a.shards}
        self.cache.pinned = set(wanted)
        for sha in [s for s in self._decoded if s not in wanted]:
            del self._decoded[sha]
        missing: dict[str, Any] = {}  # sha256 -> manifest; identical shards are fetched once
        for m in a.shards:
            if m.sha256 in self._decoded or m.sha256 in missing:
                continue
            held = self.cache.load(m.sha256, keep_quantized=keep(m.shard_id))
            if held is None:
                missing[m.sha256] = m
            else:
                self._decoded[m.sha256] = held
        by_url = {sha: m for sha, m in missing.items() if m.url}  # minor 6: a web server or CDN
        for sha, m in by_url.items():
            part = self.cache.partial_path(sha)
            try:
                download(m.url, sha, m.bytes, part, deadline=a.deadline, window=B.FETCH_WINDOW_BYTES,
                         max_bytes=MAX_SHARD_BYTES)
            except ShardDownloadError as e:
                part.unlink(missing_ok=True)
                raise ValueError(f"shard {m.shard_id}: {e}") from None
            self.cache.adopt(sha, part)
            fetched.append(m.shard_id)
        pending, active = [(sha, m) for sha, m in missing.items() if sha not in by_url], {}
        if pending:
            self._shard_rx = Reassembler(MAX_SHARD_BYTES)  # forget earlier fetches of evicted shards
        try:
            while pending or active:
                while pending and (not active or sum(x.bytes for x in active.values()) + pending[0][1].bytes
                                   <= B.FETCH_WINDOW_BYTES):
                    sha, m = pending.pop(0)
                    self.transport.subscribe(m.topic + "/#")
                    active[sha] = m
                self._wait(lambda: any(s in self._inbox.shards for s in active), a.deadline,
                           f"shard {next(iter(active.values())).shard_id}")
                for sha in [s for s in active if s in self._inbox.shards]:
                    m = active.pop(sha)
                    self.transport.unsubscribe(m.topic + "/#")
                    self.cache.put(sha, self._inbox.shards.pop(sha))
                    fetched.append(m.shard_id)
        finally:
            for m in active.values():
                self.transport.unsubscribe(m.topic + "/#")
        for sha, m in missing.items():
            held = self.cache.load(sha, keep_quantized=keep(m.shard_id))
            if held is None:
                raise ValueError(f"shard {m.shard_id} vanished from the cache")
            self._decoded[sha] = held
        return fetched

    def _model_for(self, a: Assignment, num_labels: int) -> SubMoE:
        key = (a.model.model_dump_json(), tuple(sorted((k, tuple(v)) for k, v in a.experts.items())),
               tuple(m.sha256 for m in a.shards), a.task, num_labels)
        if self._held is None or self._held.key != key:
            self._held = None
            gc.collect()  # the last sub-model's autograd/peft reference cycles, before the next one is built
            B.release_free_memory()
            shards = {m.shard_id: self._decoded[m.sha256] for m in a.shards}
            self._held = _Held(key, SubMoE(a.model, a.experts, a.task, num_labels, shards,
                                                    quant_backend=self.quant_backend))
        return self._held.model
