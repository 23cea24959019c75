"""The round engine's shared state: the transport it publishes through (:class:`Wire`),
its settings (:class:`RoundSettings`), the round in flight (:class:`OpenRound`) and what
every part of the engine reads and writes (:class:`EngineState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from protocol.messages import Ack, BlobRef, Objective, Stats, TrainConfig

from ..aggregation.base import RoundSums
from ..strategy import Experts

if TYPE_CHECKING:
    from protocol.topics import Topics

    from ..global_model import GlobalModel
    from ..programs import ProgramPublisher
    from ..registry import Registry
    from ..robust.defences import Defences
    from ..store import Store
    from ..strategies.base import Strategy
    from ..workers import Coordinator


class Wire(Protocol):
    """What the engine needs from the transport."""

    def publish(self, topic: str, payload: bytes) -> None:
        """Publish a control message (QoS 1). Raises on a transport failure."""

    def publish_blob(self, topic: str, data: bytes, kind: str, round: int,
                     transfer_id: str | None = None) -> BlobRef:
        """Publish ``data`` (bytes) as a chunked blob of ``kind`` for ``round`` on ``topic``;
        returns the reference a control message carries."""

    @property
    def chunk_payload_bytes(self) -> int:
        """Largest MQTT payload of one chunk, in bytes (the broker's packet limit)."""


@dataclass
class RoundSettings:
    """Round-engine settings (a slice of the aggregator config)."""

    clients_per_round: float = 1.0
    """<= 1: fraction of eligible devices; > 1: a count."""
    quorum: float = 0.5
    """Fraction of the selected devices whose updates must be accepted to aggregate."""
    round_timeout_s: float = 600.0
    train: TrainConfig = field(default_factory=TrainConfig)
    max_update_bytes: int = 256 * 1024**2
    eval_batch_size: int = 32
    seed: int = 0
    max_samples_per_device: int = 1_000_000
    """Largest ``num_samples`` a device's statistics may claim (its aggregation weight)."""
    state_precision: str = "fp32"
    """Precision of the adapter state sent to devices (``FederationSettings.state_precision``)."""
    state_compression: bool = False
    """Compress the adapter state for devices of minor 8 or later (``AggregatorConfig.state_compression``)."""
    shard_url: str | None = None
    """Base URL of the shard files (``AggregatorConfig.shard_url``): manifests for devices
    of minor 6 or later name their files there."""
    min_lora_rank: int | None = None
    """Heterogeneous LoRA ranks down to this (``FederationSettings.min_lora_rank``; None: off)."""
    assignment_resend_s: float = 0.0
    """Re-send an assignment that was not acknowledged this many seconds after it was sent
    (:meth:`RoundEngine.resend_unacked`; 0: never)."""


@dataclass
class Stream:
    """A streaming round's state (:mod:`cloud.rounds.streaming`): one process, a method
    that aggregates by running sums; each reported update is screened and folded in at once
    and its tensors dropped, so memory does not grow with the round."""

    sums: RoundSums = field(default_factory=RoundSums)
    warmup: list[str] | None = field(default_factory=list)
    """The round's first reporters, held whole until :data:`cloud.rounds.streaming.STREAM_WARMUP`
    of them are in (or the round closes); None once they were screened together and folded
    (or with screening off: no warm-up)."""
    references: dict[str, float] = field(default_factory=dict)
    """The reference norms the warm-up set (kind -> L2 norm), which every later update is
    screened against."""
    markers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """device -> what became of its update (``status`` folded or rejected, screening
    ``norms``/``kinds``: the markers of :mod:`cloud.workers`)."""
    unsaved: dict[str, bytes] = field(default_factory=dict)
    """device -> its accepted update's payload, not folded and not yet in the store
    (written at the end of the batch it came in, :meth:`Streaming.end_batch`)."""
    loose: dict[str, bytes] = field(default_factory=dict)
    """device -> its payload, folded within the batch it came in and not in the store: written
    at the batch's end unless the batch settles (:meth:`Streaming.end_batch`)."""
    stored: set[str] = field(default_factory=set)
    """Devices whose update payload is in the store (dropped once folded)."""
    saved: set[str] = field(default_factory=set)
    """Devices whose marker is in the store (with the sums that include them)."""
    fresh: list[str] = field(default_factory=list)
    """Devices whose marker is not in the store yet (``markers`` less ``saved``, in the order
    folded: a batch's end looks at these, not at every marker of the round)."""


@dataclass
class OpenRound:
    """The round in flight: whom it selected with which experts, its plan, and what it has
    received so far."""

    number: int
    started: float
    deadline: float
    selected: dict[str, Experts]
    plan_info: dict[str, Any]
    assignment_seconds: float
    train: dict[str, Any] = field(default_factory=dict)
    objectives: dict[str, list[Objective]] = field(default_factory=dict)
    unsent: set[str] = field(default_factory=set)
    """Devices the round could not send an assignment to (finished: nothing to wait for)."""
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    acks: dict[str, Ack] = field(default_factory=dict)
    updates: dict[str, tuple[str, dict[str, torch.Tensor]]] = field(default_factory=dict)
    stats: dict[str, Stats] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    reassigned: dict[str, dict[str, Any]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    """Online devices the round could not use, and why (each was told)."""
    offline: list[str] = field(default_factory=list)
    """Registered devices that were offline when the round started (not selected)."""
    takers: dict[str, str] = field(default_factory=dict)
    """device -> the aggregator worker that took its update (``role: coordinator``)."""
    sent: dict[str, float] = field(default_factory=dict)
    """device -> when (Unix seconds) its assignment was last sent."""
    resends: dict[str, int] = field(default_factory=dict)
    """device -> how often its assignment was re-sent unacknowledged."""
    ranks: dict[str, int] = field(default_factory=dict)
    """device -> the LoRA rank it trains, where below the model's (``min_lora_rank``)."""
    sample_cap: int | None = None
    """The cap on claimed samples that update-by-update screening applies (aggregator workers
    or a streaming round; :meth:`cloud.robust.defences.Defences.round_sample_cap`)."""
    stream: Stream | None = None
    """A streaming round's running sums and what became of each update
    (:mod:`cloud.rounds.streaming`); None: every update is held until the close."""

    reporters: set[str] | None = None
    """Devices that reported (:meth:`note_reported`; None until the first report)."""

    def note_reported(self, device_id: str) -> int:
        """Record that ``device_id`` reported; returns how many of the selected have (found
        in full once a round, then counted: per report it cost O(selected), O(n^2) a round)."""
        if self.reporters is None:
            self.reporters = {d for d in self.selected if self.reported(d)}
        self.reporters.add(device_id)
        return len(self.reporters)

    def reported(self, device_id: str) -> bool:
        """Whether ``device_id``'s update and the statistics that name it were both accepted."""
        up, st = self.updates.get(device_id), self.stats.get(device_id)
        return up is not None and st is not None and st.update.sha256 == up[0]

    def finished(self, device_id: str) -> bool:
        """Whether the round waits for nothing more from ``device_id``: it reported, refused
        its assignment, or could not be sent one."""
        ack = self.acks.get(device_id)
        return self.reported(device_id) or (ack is not None and not ack.accepted) or device_id in self.unsent


class EngineState:
    """What the parts of :class:`cloud.rounds.RoundEngine` share (set by its constructor,
    which documents them)."""

    model: GlobalModel
    registry: Registry
    store: Store
    strategy: Strategy
    wire: Wire
    topics: Topics
    settings: RoundSettings
    defences: Defences
    reject: Callable[..., None]
    progress: Callable[[str, int, dict], None]
    current: OpenRound | None
    completed: int
    coordinator: Coordinator | None
    programs: ProgramPublisher | None
