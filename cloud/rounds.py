"""The round engine: select devices, assign experts, collect, aggregate, evaluate, record.

One round (docs/architecture.md data flow):

1. Select online devices whose budget holds at least one expert per layer.
2. The strategy (:class:`cloud.strategies.Strategy`) configures the round (``Plan``):
   per device its per-layer expert set, training overrides, objective terms and extra
   tensors. An invalid entry excludes that device with the reason; a strategy that
   raises leaves the round waiting (logged, and named in the service's timeout).
3. Each device gets its slice of the global adapter state (plus the plan's extra
   tensors) on ``down/state`` and its ``assignment`` (shard manifests, training config,
   objective terms, deadline).
4. Updates (chunked safetensors) and statistics arrive; each is validated (round,
   device, names/shapes/dtypes against *that device's* assignment, finiteness,
   checksum; a statistics message's ``num_samples`` against the device's hello and
   ``max_samples_per_device``, its token and usage counts against what that many samples
   can produce) and accepted once; anything else is rejected with a reply.
   A device that refuses its assignment because its memory plan exceeds its budget
   (the ack carries its budget and baseline now) is reassigned within the same round:
   the strategy shrinks its expert sets (:meth:`Strategy.on_refusal`; by default the
   largest layer first, keeping at least one expert per layer) until the plan fits, and
   it gets the smaller assignment as a new ``attempt`` (recorded under ``reassigned``);
   if not even one expert per layer fits it counts as failed. No device is ever sent an
   assignment its declared budget cannot hold.
5. The round closes when every selected device reported or refused, or at the
   deadline. Updates are screened; with at least ``quorum`` of the selected devices
   accepted the strategy aggregates (the next global state and its own tensors), the
   pre-commit guard checks the step; otherwise the state stays.
6. The strategy evaluates; load metrics and a round record go to the store.

Crash safety: the round in flight (selection, deadline, plan) is stored before any
assignment goes out, and every accepted update and statistics message is stored when
accepted (``inflight/...``); closing a round writes the new global state, the round
record and ``last_round`` in one transaction and drops the in-flight data. A restarted
aggregator (:meth:`RoundEngine.restore`) therefore resumes the open round with what it
had accepted, and never applies a round twice.
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from pydantic import TypeAdapter, ValidationError

from moe_model.budget import (
    DEFAULT_RUNTIME_BYTES, current_rss_bytes, estimate, max_experts_per_layer, release_free_memory,
)
from moe_model.train import num_steps
from protocol.chunking import Blob
from protocol.codec import (
    EXTRA_DTYPES, CodecError, check_expected, decode_tensors, encode_tensors, extra_tensor_problem, sha256_hex,
)
from protocol.experts import experts_by_device_from_json, experts_by_device_to_json, layers_to_json
from protocol.logsafe import LogLimiter
from protocol.messages import (
    MAX_OBJECTIVES, MIN_MINOR_FOR_COMPRESSION, MIN_MINOR_FOR_EVALUATION, MIN_MINOR_FOR_EXTENSIONS,
    MIN_MINOR_FOR_SHARD_URL, MIN_MINOR_FOR_STATE_PRECISION, MIN_MINOR_FOR_UPLINK, Ack, Assignment,
    BlobRef, Command, ExtraName, Objective, Stats, TensorSpec, TrainConfig, encode,
)
from protocol.topics import Topics

from .filters import InboundFilter, UpdateDecoding
from .global_model import GlobalModel
from .metrics import LoadWindow, assigned_load, round_load
from .registry import Registry
from .robust.defences import Defences
from .robust.guard import l2_norm
from .store import Store
from .workers import Coordinator, sums_mode
from .strategies.base import Strategy
from .strategy import ClientResult, DeviceView, Experts, Failure, Plan

log = logging.getLogger(__name__)


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


MAX_CLOSE_ATTEMPTS = 2
"""A round whose closing was interrupted this many times (the process died in it) is
failed on the next restart, its messages quarantined, instead of being closed again."""


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
    assignment_resend_s: float = 0.0
    """Re-send an assignment that was not acknowledged this many seconds after it was sent
    (:meth:`RoundEngine.resend_unacked`; 0: never)."""


@dataclass
class _Round:
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
    takers: dict[str, str] = field(default_factory=dict)
    """device -> the aggregator worker that took its update (``role: coordinator``)."""
    sent: dict[str, float] = field(default_factory=dict)
    """device -> when (Unix seconds) its assignment was last sent."""
    resends: dict[str, int] = field(default_factory=dict)
    """device -> how often its assignment was re-sent unacknowledged."""
    sample_cap: int | None = None
    """The cap on claimed samples that aggregator workers apply (set by a coordinator,
    :meth:`cloud.robust.defences.Defences.round_sample_cap`)."""

    def reported(self, device_id: str) -> bool:
        up, st = self.updates.get(device_id), self.stats.get(device_id)
        return up is not None and st is not None and st.update.sha256 == up[0]

    def finished(self, device_id: str) -> bool:
        ack = self.acks.get(device_id)
        return self.reported(device_id) or (ack is not None and not ack.accepted) or device_id in self.unsent


class RoundEngine:
    """Drives rounds; the service feeds it validated messages and calls :meth:`tick`.

    Args:
        model: the global model.
        registry: registered devices.
        store: durable state.
        strategy: the federated method (:class:`cloud.strategies.Strategy`).
        wire: publishing side of the transport.
        topics: the federation's topics.
        settings: round settings.
        eval_data: task -> test items ``(input, label id)``.
        reject: ``(device_id, round, reason, *, kind=None, upload_id=None)`` -> reply to a device (the
            message kind and update transfer id it refers to, where known).
        progress: ``(event, round, detail)`` -> operator progress.
        defences: update screening, the robust/DP wrapper of the strategy's aggregation
            part and the pre-commit guard (:mod:`cloud.robust`); default: screening and
            guard on.
        filters: the incoming filters decoded updates pass (:mod:`cloud.filters`);
            default: ``[UpdateDecoding()]``.

    Raises:
        ValueError: DP-FedAvg is configured but the strategy has no aggregation part to
            replace (its privacy guarantee would silently not hold).
    """

    def __init__(
        self, model: GlobalModel, registry: Registry, store: Store, strategy: Strategy, wire: Wire, topics: Topics,
        settings: RoundSettings, eval_data: dict[str, Sequence[tuple[Any, int]]],
        reject: Callable[..., None], progress: Callable[[str, int, dict], None],
        defences: Defences | None = None, filters: Sequence[InboundFilter] | None = None,
    ):
        self.model, self.registry, self.store = model, registry, store
        self.filters = list(filters) if filters is not None else [UpdateDecoding()]
        """Incoming filters every decoded update passes (:meth:`InboundFilter.on_update`;
        default: :class:`cloud.filters.UpdateDecoding`, so any device encoding is understood)."""
        self.defences = defences or Defences()
        self.strategy = strategy
        if strategy.aggregation is not None:
            strategy.aggregation = self.defences.wrap(strategy.aggregation)
        elif self.defences.config.dp is not None:
            raise ValueError(f"defences.dp needs a strategy with an aggregation part; {strategy.name!r} aggregates "
                             f"by itself")
        elif self.defences.config.robust.name != "none":
            log.warning("strategy %r aggregates by itself: the robust rule %r does not apply (screening and the "
                        "guard do)", strategy.name, self.defences.config.robust.name)
        self.wire, self.topics, self.settings = wire, topics, settings
        self.eval_data = eval_data
        self.reject, self.progress = reject, progress
        self.current: _Round | None = None
        self.completed = int(store.get_json("last_round", 0))
        self.window = LoadWindow(model.layers, model.spec.num_experts)
        self.window.load_state_dict(store.get_json("load_window", {}))
        self.assigned_window = LoadWindow(model.layers, model.spec.num_experts)
        self.assigned_window.load_state_dict(store.get_json("assigned_window", {}))
        self.previous: dict[str, Experts] = experts_by_device_from_json(store.get_json("previous_assignment", {}))
        self._rng = random.Random(settings.seed + self.completed)
        self._idle_round = -1
        self.excluded: dict[str, str] = {}
        """The last round's (or the waiting round's) excluded devices and why."""
        self._told: dict[str, tuple[int, str]] = {}
        """device -> (round, reason) it was last told it is excluded (one message a round,
        one log line per change of reason)."""
        self.ensure_shards: Callable[[str, bool], None] | None = None
        """Called with ``(format, by_url)`` before an assignment in that format goes out: the
        service makes its shards available on first use, as files for devices that fetch by
        URL (``by_url``), else as retained messages."""
        self._notice_log = LogLimiter(log, "failed notices", per_key=3, total=10, interval_s=60.0)
        """Failed notice publishes are logged rate-limited (a broker outage must not flood the log)."""
        self.plan_error: str | None = None
        """Why the strategy could not configure the waiting round (it raised), if so."""
        self.persist_seconds: float | None = None
        """How long persisting the last closed round took (seconds)."""
        self.coordinator: Coordinator | None = None
        """Set when aggregator workers take the uploads (``--role coordinator``): the engine
        learns what they took from the store (:meth:`sync`) and closes from their sums."""

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any]:
        """The strategy's evaluation of the global model now (:meth:`Strategy.evaluate`):
        ``accuracy``/``loss`` (sample-weighted means over tasks) and ``per_task``."""
        return self.strategy.evaluate(self.completed, self.model, self.eval_data, self.settings.eval_batch_size)

    # ------------------------------------------------------------------ start
    def _runtime(self, dev) -> int:
        return DEFAULT_RUNTIME_BYTES if dev.runtime_bytes is None else dev.runtime_bytes

    def format_for(self, dev) -> str:
        """The weight format ``dev`` gets: its first preference the cloud serves."""
        return self.model.format_for(dev.weight_formats) or self.model.weight_format

    def capacity(self, dev) -> int:
        """Experts per layer ``dev``'s budget holds (0..E)."""
        labels = len(self.model.tasks.get(dev.task, [0, 1]))
        return max_experts_per_layer(self.model.spec, dev.budget_bytes, self.settings.train.batch_size, labels,
                                     self._runtime(dev), self.format_for(dev))

    def memory_fn(self, dev) -> Callable[[Experts], int]:
        """``experts -> bytes`` ``dev`` needs for a round holding them (``moe_model.budget.plan``)."""
        labels = len(self.model.tasks.get(dev.task, [0, 1]))
        batch, runtime, fmt = self.settings.train.batch_size, self._runtime(dev), self.format_for(dev)
        return lambda experts: estimate(self.model.spec, experts, batch, labels, runtime, fmt).total

    def _view(self, dev) -> DeviceView:
        """``dev`` (a registered device) as the strategy sees it."""
        return DeviceView(dev.device_id, dev.task, dev.num_samples, dev.budget_bytes, self.capacity(dev),
                          self.memory_fn(dev), self.registry.last_stats.get(dev.device_id),
                          self.previous.get(dev.device_id),
                          extra={"runtime_bytes": self._runtime(dev), "weight_format": self.format_for(dev)},
                          protocol_minor=dev.protocol_minor)

    def start_round(self) -> bool:
        """Select, assign and publish round ``completed + 1``.

        Returns:
            False if no eligible device got an assignment (nothing was published).
        """
        number = self.completed + 1
        eligible, excluded = [], {}
        for dev in self.registry.online():
            if dev.task not in self.model.tasks:
                excluded[dev.device_id] = (f"unknown task {dev.task!r}; this federation trains "
                                           f"{sorted(self.model.tasks)}", {})
            elif self.model.format_for(dev.weight_formats) is None:
                excluded[dev.device_id] = (f"loads only {dev.weight_formats} shards; the cloud serves "
                                           f"{self.model.formats}", {})
            elif self.coordinator is not None and not self.coordinator.shared_subscriptions \
                    and dev.protocol_minor < MIN_MINOR_FOR_UPLINK:
                excluded[dev.device_id] = (f"protocol minor {dev.protocol_minor} cannot send to an aggregator "
                                           f"worker's uplink partition (minor {MIN_MINOR_FOR_UPLINK}), and this "
                                           "MQTT 3.1.1 broker has no shared subscriptions: update the device SDK",
                                           {})
            else:
                eligible.append(dev)
        eligible.sort(key=lambda d: d.device_id)
        n = self.settings.clients_per_round
        count = math.ceil(n * len(eligible)) if n <= 1 else int(n)
        chosen = eligible
        if count < len(eligible):
            by_id = {d.device_id: d for d in eligible}
            try:
                picked = self.strategy.sample_devices(number, sorted(by_id), count, self._rng)
                chosen = [by_id[d] for d in dict.fromkeys(picked)]
            except Exception as e:  # a strategy bug or an unknown id: the round waits, the operator is told
                error = f"strategy {self.strategy.name!r} could not sample round {number}: {type(e).__name__}: {e}"
                if error[:500] != self.plan_error:
                    log.error("round %d: %s", number, error)
                self.plan_error = error[:500]
                return False
        views = [self._view(d) for d in chosen]
        for v in views:
            if v.capacity < 1:
                excluded[v.device_id] = self._too_small(v)
        t0 = time.perf_counter()
        try:
            plan = self.strategy.configure_round(number, views, self.model)
        except Exception as e:  # a strategy bug must not stop the service: the round waits, the operator is told
            error = f"strategy {self.strategy.name!r} could not configure round {number}: {type(e).__name__}: {e}"
            if error != self.plan_error:
                log.exception("round %d: %s", number, error)
            self.plan_error = error[:500]
            return False
        self.plan_error = None
        seconds = time.perf_counter() - t0
        for d, why in self._invalid_entries(plan, views).items():
            log.error("round %d: %s; %s sits this round out", number, why, d)
            plan.assignments.pop(d, None)
            excluded[d] = (why, {})
        for d in plan.assignments:  # a strategy may fit a device below one expert per layer (a smaller batch)
            excluded.pop(d, None)
        self._add_configured_objectives(plan)
        self._ask_evaluation(number, plan, views)
        for v in views:
            if v.device_id not in plan.assignments and v.device_id not in excluded:
                excluded[v.device_id] = (plan.excluded.get(v.device_id) or f"the '{self.strategy.label}' strategy "
                                         f"gave it no experts this round (its budget holds {v.capacity} per layer)", {})
        self._tell_excluded(number, excluded)
        if not plan.assignments:
            if number != self._idle_round:
                self._idle_round = number
                log.warning("round %d: no device could be assigned (eligible: %s, capacities %s); waiting", number,
                            [d.device_id for d in eligible], {v.device_id: v.capacity for v in views})
            return False
        now = time.time()
        rnd = _Round(number, now, now + self.settings.round_timeout_s,
                     {d: Experts(e) for d, e in plan.assignments.items()},
                     plan.info, seconds, excluded=dict(self.excluded))
        rnd.train = {d: t for d, t in plan.train.items() if d in rnd.selected}
        rnd.objectives = {d: list(o) for d, o in plan.objectives.items() if d in rnd.selected and o}
        rnd.tensors = {d: {k: t.detach().clone() for k, t in x.items()}
                       for d, x in plan.tensors.items() if d in rnd.selected and x}
        if self.coordinator is not None:  # workers screen update by update: the cap must be known now
            rnd.sample_cap = self.defences.round_sample_cap(
                [dev.num_samples for d in rnd.selected if (dev := self.registry.get(d)) is not None])
        self.current = rnd
        for d, tensors in rnd.tensors.items():  # a restart re-sends the same assignment
            self.store.put_blob(f"inflight/{number}/tensors/{d}", encode_tensors(tensors, "fp32"))
        self.store.put_json("strategy_state", self.strategy.state_dict())  # what configuring the round changed
        self.store.put_json("current_round", {
            "number": number, "started": rnd.started, "deadline": rnd.deadline, "plan_info": _jsonable(plan.info),
            "assignment_seconds": seconds, "train": rnd.train, "excluded": rnd.excluded,
            "selected": experts_by_device_to_json(rnd.selected),
            "objectives": {d: [o.model_dump(mode="json") for o in x] for d, x in rnd.objectives.items()},
            "sample_cap": rnd.sample_cap,
        })
        for device_id, experts in rnd.selected.items():
            self._send_assignment(rnd, device_id, experts)
        log.info("round %d: %d devices assigned (%s, %.3f s)", number, len(rnd.selected), self.strategy.label,
                 seconds)
        self.progress("round_start", number, {"devices": sorted(rnd.selected), "assignment_seconds": seconds,
                                              "excluded": rnd.excluded})
        return True

    def _add_configured_objectives(self, plan: Plan) -> None:
        """Add the strategy's configured terms (``strategy.params.objectives``) to every
        assigned device's plan, after the terms the method planned (none named twice)."""
        for d in plan.assignments:
            planned = list(plan.objectives.get(d) or [])
            names = {getattr(o, "name", None) for o in planned}
            extra = [o for o in self.strategy.objectives if o.name not in names]
            if extra:
                plan.objectives[d] = [*planned, *extra]

    def _ask_evaluation(self, number: int, plan: Plan, views: list[DeviceView]) -> None:
        """Add the evaluation term to the plan of the devices the strategy's
        :meth:`Strategy.configure_evaluate` names (those of protocol minor >= 3; a
        strategy bug there is logged and evaluation skipped for the round)."""
        planned = [v for v in views if v.device_id in plan.assignments]
        try:
            ask = set(self.strategy.configure_evaluate(number, planned))
        except Exception:
            log.exception("round %d: the strategy's configure_evaluate failed; no federated evaluation", number)
            return
        term = self.strategy.EVALUATION_TERM
        for v in planned:
            objectives = list(plan.objectives.get(v.device_id) or [])
            if v.device_id in ask and v.protocol_minor >= MIN_MINOR_FOR_EVALUATION and \
                    len(objectives) < MAX_OBJECTIVES and all(getattr(o, "name", None) != term for o in objectives):
                plan.objectives[v.device_id] = [*objectives, Objective(name=term)]

    def _invalid_entries(self, plan: Plan, views: list[DeviceView]) -> dict[str, str]:
        """device -> why the strategy's plan for it cannot be sent: not a selected device,
        experts not covering each MoE layer with 1..E distinct ids, more than its budget
        holds, a training override the schema refuses, or objectives and extra tensors
        for a device older than protocol minor 2 or ill-formed."""
        by_id, bad = {v.device_id: v for v in views}, {}
        who = f"the '{self.strategy.label}' strategy's plan"
        E = self.model.spec.num_experts
        for d, experts in plan.assignments.items():
            view = by_id.get(d)
            if view is None:
                bad[d] = f"{who} names {d}, which was not selected"
                continue
            layers_ok = set(experts) == set(self.model.layers) and all(
                v and len(set(v)) == len(v)
                and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < E for e in v)
                for v in experts.values())
            if not layers_ok:
                bad[d] = f"{who} gives it experts {experts}, not 1..{E} distinct ids for each of layers " \
                         f"{self.model.layers}"
                continue
            # Per-layer counts may differ: beyond the uniform capacity, the memory estimate decides.
            over = any(len(v) > max(view.capacity, 1) for v in experts.values()) and (
                view.memory is None or view.memory(experts) > view.budget_bytes)
            if over:
                bad[d] = f"{who} gives it {[len(v) for v in experts.values()]} experts per layer, more than its " \
                         f"budget of {view.budget_bytes / 2**20:.0f} MiB holds"
                continue
            try:
                self._train_for_overrides(plan.train.get(d))
            except ValidationError as e:
                bad[d] = f"{who} sets invalid training overrides: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
                continue
            objectives, tensors = plan.objectives.get(d) or [], plan.tensors.get(d) or {}
            if (objectives or tensors) and view.protocol_minor < MIN_MINOR_FOR_EXTENSIONS:
                bad[d] = (f"{who} needs objective terms or extra tensors, which its SDK (protocol minor "
                          f"{view.protocol_minor}) cannot use; update the device SDK to minor "
                          f"{MIN_MINOR_FOR_EXTENSIONS} or later")
                continue
            problem = _tensors_problem(tensors) or next(
                (f"objective {o!r} is not an Objective" for o in objectives if not isinstance(o, Objective)), None) or (
                f"{len(objectives)} objective terms, more than {MAX_OBJECTIVES}" if len(objectives) > MAX_OBJECTIVES
                else None)
            if problem:
                bad[d] = f"{who} for it is ill-formed: {problem}"
        return bad

    def _too_small(self, view: DeviceView) -> tuple[str, dict[str, int]]:
        """Why ``view``'s budget holds no expert per layer, with the figures."""
        need = view.memory({layer: [0] for layer in self.model.layers})
        runtime, fmt = view.extra["runtime_bytes"], view.extra["weight_format"]
        return (f"budget {view.budget_bytes / 2**20:.0f} MiB is below the {need / 2**20:.0f} MiB memory plan for one "
                f"expert per layer ({fmt}; runtime baseline {runtime / 2**20:.0f} MiB)",
                {"budget_bytes": view.budget_bytes, "needed_bytes": need, "runtime_bytes": runtime})

    def _tell_excluded(self, number: int, excluded: dict[str, tuple[str, dict[str, int]]]) -> None:
        """Send each excluded device a ``Command(excluded)`` once for round ``number``, and
        log once per device and change of reason (nobody is left out in silence)."""
        self.excluded = {d: why for d, (why, _) in excluded.items()}
        for d, (why, figures) in sorted(excluded.items()):
            told = self._told.get(d)
            if told is not None and told[0] == number and told[1] == why:
                continue
            if told is None or told[1] != why:
                log.warning("round %d: %s cannot be used: %s", number, d, why)
            self._told[d] = (number, why)
            self._notify(d, Command(command="excluded", round=number, reason=why[:2000], **figures))
        for d in [d for d in self._told if d not in excluded]:
            del self._told[d]  # usable again: a later exclusion is a change worth logging

    def _notify(self, device_id: str, cmd: Command) -> None:
        """Send ``cmd`` to ``device_id`` best effort: a failed publish is logged, never raised
        (a notice must not stop the round engine)."""
        try:
            self.wire.publish(self.topics.down(device_id, "command"), encode(cmd))
        except Exception as e:
            self._notice_log.log(f"{cmd.command} notice failed", logging.WARNING, "could not send %s to %s: %s",
                                 cmd.command, device_id, str(e)[:200])

    def _send_assignment(self, rnd: _Round, device_id: str, experts: Experts) -> None:
        dev = self.registry.get(device_id)
        fmt = self.format_for(dev)
        url = self.settings.shard_url if dev.protocol_minor >= MIN_MINOR_FOR_SHARD_URL else None
        if self.ensure_shards is not None:
            self.ensure_shards(fmt, url is not None)
        tensors = rnd.tensors.get(device_id, {})
        try:
            sent = self._sent_state(device_id, experts)
        except Exception as e:  # a strategy bug: this device sits the round out, the round goes on
            log.exception("round %d: no state to send %s", rnd.number, device_id)
            rnd.rejected[device_id] = f"the strategy gave no valid state to send: {type(e).__name__}: {e}"[:500]
            rnd.unsent.add(device_id)
            return
        precision = self.settings.state_precision if dev.protocol_minor >= MIN_MINOR_FOR_STATE_PRECISION else "fp32"
        state = encode_tensors({**sent, **tensors}, precision, exact=tensors,
                               compress=self.settings.state_compression
                               and dev.protocol_minor >= MIN_MINOR_FOR_COMPRESSION)
        ref = self.wire.publish_blob(self.topics.down(device_id, "state"), state, "state", rnd.number,
                                     uuid.uuid4().hex[:16])
        msg = Assignment(
            round=rnd.number, model_version=self.model.version, model=self.model.spec, task=dev.task,
            labels=self.model.tasks[dev.task], experts=experts,
            shards=self.model.manifests(experts, self.topics, self.wire.chunk_payload_bytes, fmt, url),
            weight_format=fmt, state=ref, attempt=rnd.attempts.get(device_id, 0),
            train=self._train_for(rnd, device_id), deadline=rnd.deadline,
            objectives=rnd.objectives.get(device_id, []),
            tensors={k: TensorSpec(shape=list(t.shape), dtype=_DTYPE_NAMES[t.dtype]) for k, t in tensors.items()},
            compressed_updates=True,
            uplink=self.coordinator.uplink(device_id) if self.coordinator is not None
            and dev.protocol_minor >= MIN_MINOR_FOR_UPLINK else None,
        )
        self.wire.publish(self.topics.down(device_id, "assignment"), encode(msg))
        rnd.sent[device_id] = time.time()

    # ------------------------------------------------------------------ incoming
    def check_current(self, device_id: str, round_: int, what: str, upload_id: str | None = None) -> _Round | None:
        """The open round if ``what`` (a message kind) of ``device_id`` for ``round_`` belongs
        to it; else None, and the device is told why (stale or early round, not selected)."""
        rnd = self.current
        if rnd is None or round_ != rnd.number:
            cur = rnd.number if rnd else self.completed
            self.reject(device_id, round_,
                        f"{what} for round {round_} rejected: current round is {cur} (stale or early)",
                        kind=what, upload_id=upload_id)
            return None
        if device_id not in rnd.selected:
            self.reject(device_id, round_, f"{what} rejected: {device_id} was not selected in round {round_}",
                        kind=what, upload_id=upload_id)
            return None
        return rnd

    def on_ack(self, device_id: str, ack: Ack) -> None:
        """A device accepted or refused its assignment (``ack.attempt`` must be the current
        one; repeats are ignored). A refusal that reports a budget and the memory needed
        asks the strategy for a smaller assignment (:meth:`_reassign`). A refusal after an
        acceptance is a device that failed during the round (its training raised): it
        counts as finished, so the round need not wait for its deadline. Never raises for
        bad input: a stale round or an unselected device gets a reject reply."""
        rnd = self.check_current(device_id, ack.round, "ack")
        if rnd is None or ack.attempt != rnd.attempts.get(device_id, 0):
            return
        prev = rnd.acks.get(device_id)
        if prev is not None and not (prev.accepted and not ack.accepted and device_id not in rnd.updates):
            return
        rnd.acks[device_id] = ack
        self.store.put_json(f"inflight/{rnd.number}/ack/{device_id}", ack.model_dump(mode="json"))
        if not ack.accepted:
            log.warning("round %d: %s refused its assignment: %s", rnd.number, device_id, ack.reason)
            if ack.needed_bytes is not None and ack.budget_bytes is not None and device_id not in rnd.updates:
                self._reassign(rnd, device_id, ack)

    MAX_ATTEMPTS = 3

    def _reassign(self, rnd: _Round, device_id: str, ack: Ack) -> None:
        """Shrink a device's assignment to what its (updated) budget holds and send it
        again as the next attempt (module docstring, step 4)."""
        self.registry.update_memory(device_id, ack.budget_bytes, ack.runtime_bytes)
        dev = self.registry.get(device_id)
        attempt = rnd.attempts.get(device_id, 0) + 1
        before = rnd.selected[device_id]
        view = self._view(dev)
        need = view.memory
        try:
            experts = self.strategy.on_refusal(rnd.number, view, {k: list(v) for k, v in before.items()}, ack)
        except Exception:  # a strategy bug: the device sits this round out, the round goes on
            log.exception("round %d: the strategy failed to answer %s's refusal", rnd.number, device_id)
            experts = None
        if experts is not None:
            experts = {k: sorted(v) for k, v in experts.items()}
            if self._invalid_entries(Plan({device_id: experts}), [view]):
                experts = None
        fits = experts is not None and need(experts) <= dev.budget_bytes
        experts = Experts(experts) if fits else before
        info = {"attempt": attempt, "reason": ack.reason, "budget_bytes": dev.budget_bytes,
                "needed_bytes": ack.needed_bytes, "from": before.to_json(), "to": experts.to_json() if fits else None}
        rnd.reassigned[device_id] = info
        if not fits or attempt > self.MAX_ATTEMPTS or experts == before:
            log.warning("round %d: %s cannot be reassigned within %.0f MiB; it sits this round out", rnd.number,
                        device_id, dev.budget_bytes / 2**20)
            info["to"] = None
            return
        rnd.acks.pop(device_id, None)
        self.store.delete(f"inflight/{rnd.number}/ack/{device_id}")
        rnd.attempts[device_id] = attempt
        rnd.selected[device_id] = experts
        cur = self.store.get_json("current_round")
        if cur is not None and cur.get("number") == rnd.number:
            cur["selected"][device_id] = experts.to_json()
            cur.setdefault("attempts", {})[device_id] = attempt
            self.store.put_json("current_round", cur)
        log.info("round %d: %s reassigned within its budget (%s -> %s experts per layer, attempt %d)", rnd.number,
                 device_id, [len(v) for v in before.values()], [len(v) for v in experts.values()], attempt)
        self._send_assignment(rnd, device_id, experts)

    def on_update(self, device_id: str, blob: Blob) -> None:
        """A reassembled update blob (safetensors bytes, checksum verified by the transport
        layer): decoded against exactly the names, shapes and dtypes of ``device_id``'s
        assignment (finite values, at most ``max_update_bytes``), stored in flight, and
        accepted once; a second, different update for the round is refused with a reply,
        an exact repeat ignored. Never raises for bad input."""
        refers = {"kind": "update", "upload_id": blob.header.id}
        rnd = self.check_current(device_id, blob.header.round, "update", blob.header.id)
        if rnd is None:
            return
        if device_id in rnd.updates:
            if rnd.updates[device_id][0] != blob.header.sha:
                self.reject(device_id, rnd.number, "a second, different update for this round was ignored", **refers)
            return
        try:
            tensors = self.decode_update(device_id, rnd.selected[device_id], blob.data)
        except Exception as e:  # CodecError, or the strategy's sent state failing its layout check
            rnd.rejected[device_id] = str(e)
            self.reject(device_id, rnd.number, f"update rejected: {e}", **refers)
            return
        rnd.updates[device_id] = (blob.header.sha, tensors)
        self.store.put_blob(f"inflight/{rnd.number}/update/{device_id}", blob.data)
        self._maybe_report(rnd, device_id)

    def _sent_state(self, device_id: str, experts: Experts) -> dict[str, torch.Tensor]:
        """The adapter state the strategy sends ``device_id`` holding ``experts``
        (:meth:`Strategy.state_for`), checked against the model's layout for it.

        Raises:
            ValueError: the strategy's state has other names or shapes.
        """
        task = self.registry.get(device_id).task
        state = self.strategy.state_for(device_id, task, experts, self.model)
        try:
            check_expected(state, self.model.expected_for(experts, task))
        except CodecError as e:
            raise ValueError(f"strategy {self.strategy.name!r} sends {device_id} a state that is not the model's "
                             f"layout for its experts: {e}") from None
        return state

    def decode_update(self, device_id: str, experts: Experts, data: bytes) -> dict[str, torch.Tensor]:
        """An update payload as fp32 tensors of exactly the layout ``device_id`` holding
        ``experts`` must send, through the incoming filters (precision, delta).

        Raises:
            CodecError: malformed, oversized, non-finite or not that layout.
        """
        task = self.registry.get(device_id).task
        meta: dict[str, str] = {}
        tensors = decode_tensors(data, self.settings.max_update_bytes, self.model.expected_for(experts, task),
                                 as_float=torch.float32, metadata_out=meta)
        for f in self.filters:
            tensors = f.on_update(device_id, tensors, meta, lambda: self._sent_state(device_id, experts))
        return tensors

    def on_stats(self, device_id: str, stats: Stats) -> None:
        """A device's round statistics (schema-valid): bounded by :meth:`_stats_problem`
        (claimed samples, token and usage counts) and the strategy's
        :meth:`Strategy.stats_problem`, stored in flight and accepted once; refused with a
        reply otherwise. Never raises for bad input."""
        rnd = self.check_current(device_id, stats.round, "stats", stats.update.transfer_id if stats.update else None)
        if rnd is None:
            return
        if device_id in rnd.stats:
            return
        dev = self.registry.get(device_id)
        problem = self.stats_problem(rnd, device_id, stats)
        if problem:
            rnd.rejected[device_id] = problem
            self.reject(device_id, rnd.number, f"stats rejected: {problem}", kind="stats",
                        upload_id=stats.update.transfer_id if stats.update else None)
            return
        rnd.stats[device_id] = stats
        if stats.baseline_rss_bytes and stats.baseline_rss_bytes != dev.runtime_bytes:
            self.registry.update_memory(device_id, None, stats.baseline_rss_bytes)  # later plans use it
        self.store.put_json(f"inflight/{rnd.number}/stats/{device_id}", stats.model_dump(mode="json"))
        self._maybe_report(rnd, device_id)

    def stats_problem(self, rnd: _Round, device_id: str, stats: Stats) -> str | None:
        """Why ``device_id``'s statistics for ``rnd`` cannot be accepted (:meth:`_stats_problem`
        against its hello and assignment, then the strategy's
        :meth:`Strategy.stats_problem`), or None."""
        dev = self.registry.get(device_id)
        if dev is None:
            return f"unknown device {device_id!r}"
        return self._stats_problem(stats, rnd.selected[device_id], dev.task, dev.num_samples,
                                   self._train_for(rnd, device_id)) or self.strategy.stats_problem(device_id, stats)

    def _train_for(self, rnd: _Round, device_id: str) -> TrainConfig:
        """The training configuration ``device_id``'s assignment carries this round."""
        return self._train_for_overrides(rnd.train.get(device_id))

    def _train_for_overrides(self, overrides: dict[str, Any] | None) -> TrainConfig:
        """The round's training configuration with a plan's per-device ``overrides``.

        Raises:
            pydantic.ValidationError: an unknown field or a value out of range.
        """
        return TrainConfig.model_validate({**self.settings.train.model_dump(), **overrides}) if overrides else \
            self.settings.train

    def _stats_problem(self, stats: Stats, experts: Experts, task: str, declared: int | None = None,
                       train: TrainConfig | None = None) -> str | None:
        """Why ``stats`` cannot be accepted, or None.

        A signing device may still lie, so what it claims is bounded: ``num_samples`` (its
        aggregation weight) by ``declared`` (the device's hello) and by
        ``max_samples_per_device``; each layer's ``tokens`` by what that many samples can
        produce in the round's training (``train``: steps x batch size x ``max_seq_len``),
        its usage counts by ``tokens x top_k`` and its per-expert sample counts by the
        samples trained on.
        """
        n, cap = stats.num_samples, self.settings.max_samples_per_device
        if declared is not None and n > declared:
            return f"num_samples {n} exceeds the {declared} samples its hello declared"
        if n > cap:
            return f"num_samples {n} exceeds the aggregator's max_samples_per_device {cap}"
        if stats.task != task:
            return f"task {stats.task!r} differs from the registered {task!r}"
        E = self.model.spec.num_experts
        if sorted(ls.layer for ls in stats.layers) != sorted(self.model.layers):
            return f"layers {[ls.layer for ls in stats.layers]} differ from the model's {self.model.layers}"
        for ls in stats.layers:
            if len(ls.usage) != E:
                return f"layer {ls.layer}: {len(ls.usage)} experts reported, model has {E}"
            held = set(experts[ls.layer])
            if any(u > 0 and e not in held for e, u in enumerate(ls.usage)):
                return f"layer {ls.layer}: usage reported for experts it does not hold"
        train = train or self.settings.train
        seen = num_steps(train, n) * train.batch_size  # samples local training can visit
        max_tokens, top_k = seen * self.model.spec.max_seq_len, self.model.spec.top_k
        for ls in stats.layers:
            if ls.tokens > max_tokens:
                return (f"layer {ls.layer}: {ls.tokens} tokens exceed the {max_tokens} that {n} samples can give "
                        f"({seen} sample visits x max_seq_len {self.model.spec.max_seq_len})")
            if sum(ls.usage) > ls.tokens * top_k:
                return f"layer {ls.layer}: usage {sum(ls.usage)} exceeds tokens x top_k = {ls.tokens} x {top_k}"
            if sum(ls.expert_samples) > seen:
                return f"layer {ls.layer}: expert_samples {sum(ls.expert_samples)} exceed the {seen} sample visits"
        return None

    def _maybe_report(self, rnd: _Round, device_id: str) -> None:
        if rnd.reported(device_id):
            st = rnd.stats[device_id]
            log.info("round %d: update from %s accepted (%d/%d)", rnd.number, device_id,
                     sum(rnd.reported(d) for d in rnd.selected), len(rnd.selected))
            self.progress("report", rnd.number, {"device": device_id, "val_accuracy": st.val_accuracy,
                                                 "reported": sum(rnd.reported(d) for d in rnd.selected),
                                                 "selected": len(rnd.selected)})
        elif device_id in rnd.stats and device_id in rnd.updates:
            st = rnd.stats[device_id]
            self.reject(device_id, rnd.number, "stats reference an update other than the one received", kind="stats",
                        upload_id=st.update.transfer_id if st.update else None)

    # ------------------------------------------------------------------ close
    def should_close(self, now: float | None = None) -> bool:
        """Whether the open round is due to close: ``now`` (Unix seconds; default: the
        clock) is past its deadline, or every selected device reported or refused."""
        rnd = self.current
        if rnd is None:
            return False
        now = time.time() if now is None else now
        return now >= rnd.deadline or all(rnd.finished(d) for d in rnd.selected)

    def close_round(self) -> dict[str, Any]:
        """Screen, aggregate (given a quorum), guard, evaluate, persist and return the
        round record.

        Nothing a device sent can stop the service here: an exception anywhere in
        closing (a strategy bug, a message that makes aggregation raise) fails this
        round only. Its record says why, the previous global state stays, devices are
        told, and its accepted messages move to ``quarantine/{round}/`` in the store, so
        a restart does not replay them.
        """
        rnd = self.current
        assert rnd is not None
        before, owned_before = dict(self.model.state), dict(self.model.owned)
        attempt = self.store.get_json("closing_round", {})
        attempts = attempt.get("attempts", 0) + 1 if attempt.get("round") == rnd.number else 1
        self.store.put_json("closing_round", {"round": rnd.number, "attempts": attempts})
        try:
            return self._close(rnd, before, owned_before)
        except Exception as e:
            log.exception("round %d: closing failed; the round fails and its messages are quarantined", rnd.number)
            self.model.set_state(before)
            self.model.set_owned(owned_before)
            return self._fail(rnd, f"{type(e).__name__}: {e}"[:500])

    def _fail(self, rnd: _Round, error: str) -> dict[str, Any]:
        """Close ``rnd`` as failed without a new global state: devices told, record
        stored, its accepted messages quarantined."""
        self._tell_failed(rnd, error)
        record = {"round": rnd.number, "status": "failed", "error": error, "accuracy": None, "loss": None,
                  "per_task": {}, "seconds": time.time() - rnd.started, "selected": sorted(rnd.selected),
                  "failures": {}, "devices": {}}
        with self.store.transaction():
            self._persist(record)
        self.current = None
        self.completed = rnd.number
        return record

    def sync(self, markers: dict[str, dict[str, Any]] | None = None) -> int:
        """Coordinator: take in the updates the aggregator workers took in the open round since
        the last call (their markers, :mod:`cloud.workers`; ``markers`` if already read), and
        why they refused others. An update stored for the coordinator (a method that does not
        decompose into sums) is decoded now; a folded one is not held. Returns how many were new.
        Raises StoreError."""
        rnd = self.current
        if rnd is None or self.coordinator is None:
            return 0
        markers = self.coordinator.markers(rnd.number, rnd.updates) if markers is None else markers
        new = 0
        for d, m in markers.items():
            if d in rnd.updates or d not in rnd.selected:
                continue
            tensors: dict[str, torch.Tensor] = {}
            if m.get("status") == "stored":
                try:
                    data = self.store.get_blob(f"inflight/{rnd.number}/update/{d}") or b""
                    if sha256_hex(data) != m["sha"]:  # replaced by a later, different upload
                        raise CodecError("the stored update is not the one the worker took")
                    tensors = self.decode_update(d, rnd.selected[d], data)
                except Exception as e:  # a worker accepted it; it must not stop the coordinator now
                    rnd.rejected[d] = f"stored update does not decode: {type(e).__name__}: {e}"[:500]
                    continue
            rnd.stats[d] = Stats.model_validate(m["stats"])
            rnd.updates[d] = (m["sha"], tensors)
            rnd.takers[d] = m.get("worker", "?")
            new += 1
        for d, why in self.coordinator.refusals(rnd.number).items():
            if d in rnd.selected and d not in rnd.updates:
                rnd.rejected[d] = why
        return new

    def _close(self, rnd: _Round, before: dict[str, torch.Tensor],
               owned_before: dict[str, torch.Tensor]) -> dict[str, Any]:
        markers, sums = {}, None
        if self.coordinator is not None:  # no worker takes an update after this; their sums are final
            markers, sums = self.coordinator.fence(rnd.number)
            self.sync(markers)
            if not sums_mode(self):
                sums = None
        results, failures = [], []
        for d, experts in sorted(rnd.selected.items()):
            dev = self.registry.get(d)
            if rnd.reported(d):
                st = rnd.stats[d]
                results.append(ClientResult(d, dev.task, st.num_samples, experts, rnd.updates[d][1], st))
            else:
                ack = rnd.acks.get(d)
                reason = rnd.rejected.get(d) or (ack.reason if ack is not None and not ack.accepted else None)
                failures.append(Failure(d, reason or "no update before the deadline"))
        screened = Coordinator.screened(self.defences.screen, results, markers) if sums is not None else \
            self.defences.screen_round(rnd.number, before, results)
        for d, why in screened.rejected.items():
            failures.append(Failure(d, f"update rejected by screening: {why}"))
            self.reject(d, rnd.number, f"update rejected: {why}", kind="update")
        accepted = screened.results
        need = max(1, math.ceil(self.settings.quorum * len(rnd.selected)))
        status = "ok" if len(accepted) >= need else "no_quorum"
        error, step, metrics = None, 0.0, {}
        try:
            if status == "ok":
                out = self.strategy.finish(rnd.number, self.model, sums) if sums is not None else \
                    self.strategy.aggregate(rnd.number, self.model, accepted, failures)
                new, metrics = out.state, out.metrics
                step = l2_norm(new[k] - before[k] for k in before)
                problem = self.defences.guard.problem(before, new, step)
                if problem:  # pre-commit guard: the previous state stays
                    raise _Refused(problem)
                self.model.set_state(new)
                if out.owned is not None:
                    self.model.set_owned(out.owned)
            else:
                log.warning("round %d: %d/%d updates, quorum %d not met; global model unchanged", rnd.number,
                            len(accepted), len(rnd.selected), need)
            self.strategy.observe(rnd.number, results, failures)
            ev = self.strategy.evaluate(rnd.number, self.model, self.eval_data, self.settings.eval_batch_size)
        except Exception as e:  # a strategy or evaluation bug must not stop the service
            if isinstance(e, _Refused):
                log.warning("round %d: the pre-commit guard refused the new global state: %s", rnd.number, e)
                error = f"guard: {e}"
            else:
                log.exception("round %d: aggregation or evaluation failed; global model unchanged", rnd.number)
                error = f"{type(e).__name__}: {e}"[:500]
            status, step, metrics = "failed", 0.0, {}
            self.model.set_state(before)
            self.model.set_owned(owned_before)
            ev = {"accuracy": None, "loss": None, "per_task": {}}
            self._tell_failed(rnd, error)
        load = round_load(({ls.layer: ls.usage for ls in r.stats.layers} for r in accepted), self.model.layers,
                          self.model.spec.num_experts)
        self.window.add(load)
        self.assigned_window.add(assigned_load(((r.num_samples, r.experts) for r in accepted), self.model.layers,
                                               self.model.spec.num_experts))
        release_free_memory()  # what aggregation and evaluation freed goes back to the OS before RSS is recorded
        record = self._record(rnd, accepted, failures, status, ev, load)
        record["global_state_norm"] = l2_norm(self.model.state.values())
        record["global_step_norm"] = step
        record["screening"] = screened.report
        report = getattr(self.strategy.aggregation, "report", None)
        if status == "ok" and report:
            record["aggregation_report"] = _jsonable(report)
        if metrics:
            record["strategy_metrics"] = _jsonable(metrics)
        fed_eval = self._federated_evaluation(rnd, accepted)
        if fed_eval is not None:
            record["federated_evaluation"] = fed_eval
        if error is not None:
            record["error"] = error
        if status == "ok":
            self.defences.guard.committed(step)
        for r in accepted:
            self.previous[r.device_id] = r.experts
        with self.store.transaction():
            for r in accepted:
                self.registry.accepted(r.device_id, r.stats)
            self._persist(record)
        self.current = None
        self.completed = rnd.number
        log.info("round %d closed (%s): accuracy %s, %d/%d updates, %.1f s", rnd.number, status,
                 f"{ev['accuracy']:.4f}" if ev["accuracy"] is not None else "n/a", len(accepted), len(rnd.selected),
                 record["seconds"])
        self.progress("round_end", rnd.number, {k: record[k] for k in ("accuracy", "loss", "mean_local_accuracy",
                                                                         "seconds", "status", "cv")})
        return record

    def _federated_evaluation(self, rnd: _Round, results: list[ClientResult]) -> dict[str, Any] | None:
        """The strategy's combination of what the devices asked to evaluate reported
        (``Stats.extras`` of :attr:`Strategy.EVALUATION_TERM`), or None. Reports from
        devices that were not asked, or claiming more samples than the device declared
        in its hello, are refused (listed under ``refused``), never combined."""
        term = self.strategy.EVALUATION_TERM
        prefix, number, reports, refused = term + ".", rnd.number, {}, {}
        for r in results:
            if not any(k.startswith(prefix) for k in r.stats.extras):
                continue
            if all(o.name != term for o in rnd.objectives.get(r.device_id, [])):
                refused[r.device_id] = "reported an evaluation it was not asked for"
                continue
            report = {k[len(prefix):]: v[0] for k, v in r.stats.extras.items() if k.startswith(prefix) and len(v) == 1}
            declared = self.registry.get(r.device_id).num_samples
            if not isinstance(report.get("samples"), (int, float)) or report["samples"] > declared:
                refused[r.device_id] = f"claims {report.get('samples')} validation samples of its {declared}"
                continue
            reports[r.device_id] = report
        try:
            out = self.strategy.evaluate_federated(number, reports)
            if out is None and refused:
                out = {"accuracy": None, "loss": None, "samples": 0, "devices": [], "refused": {}}
            if out is not None:
                out["refused"] = {**out.get("refused", {}), **refused}
            return _jsonable(out)
        except Exception:
            log.exception("round %d: the strategy's evaluate_federated failed", number)
            return None

    def _tell_failed(self, rnd: _Round, error: str) -> None:
        for d in rnd.selected:
            self._notify(d, Command(command="round_failed", round=rnd.number,
                                    reason=f"the cloud could not aggregate or evaluate round {rnd.number} "
                                           f"({error}); the global model is unchanged"))

    def _record(self, rnd: _Round, results: list[ClientResult], failures: list[Failure], status: str,
                ev: dict[str, Any], load: dict[int, list[int]]) -> dict[str, Any]:
        devices = {}
        for r in results:
            st, dev = r.stats, self.registry.get(r.device_id)
            devices[r.device_id] = {
                "task": r.task, "bytes_up": st.bytes_up, "bytes_down": st.bytes_down,
                "payload_up": st.payload_up, "payload_down": st.payload_down,
                "peak_rss_bytes": st.peak_rss_bytes, "peak_footprint_bytes": st.peak_footprint_bytes,
                # what the budget is held against: the footprint from minor-5 devices, RSS before
                "peak_bytes": st.peak_footprint_bytes or st.peak_rss_bytes, "baseline_rss_bytes": st.baseline_rss_bytes,
                "budget_bytes": dev.budget_bytes, "experts": Experts(r.experts).to_json(),
                "shards_fetched": st.shards_fetched, "samples": st.num_samples, "val_accuracy": st.val_accuracy,
                "train_loss": st.train_loss, "train_seconds": st.train_seconds,
                "predicted_peak_bytes": st.predicted_peak_bytes, "weight_format": st.weight_format,
                **({"extras": st.extras} if st.extras else {}),  # what the objective terms reported
                **({"worker": rnd.takers[r.device_id]} if r.device_id in rnd.takers else {}),
            }
        local = [r.stats.val_accuracy for r in results if r.stats.val_accuracy is not None]
        return {
            "round": rnd.number,
            "status": status,
            "accuracy": ev["accuracy"],
            "loss": ev["loss"],
            **({"perplexity": ev["perplexity"]} if "perplexity" in ev else {}),
            **({"fused": ev["fused"]} if "fused" in ev else {}),  # fusion_hybrid: the fused server MoE's figures
            "per_task": ev["per_task"],
            "mean_local_accuracy": sum(local) / len(local) if local else None,
            "train_loss": sum(r.stats.train_loss for r in results) / len(results) if results else None,
            "seconds": time.time() - rnd.started,
            "bytes_up": sum(d["bytes_up"] for d in devices.values()),
            "bytes_down": sum(d["bytes_down"] for d in devices.values()),
            "expert_load": layers_to_json(load),
            **self.window.summary(),
            **self.assigned_window.summary("assigned_"),
            "strategy": self.strategy.name,
            "assignment": {"strategy": self.strategy.label, "seconds": rnd.assignment_seconds, **rnd.plan_info},
            "assignment_seconds": rnd.assignment_seconds,
            "assignment_status": rnd.plan_info.get("status", "ok"),
            "selected": sorted(rnd.selected),
            "failures": {f.device_id: f.reason for f in failures},
            "reassigned": rnd.reassigned,
            "excluded": rnd.excluded,
            "aggregator_rss_bytes": current_rss_bytes(),
            "devices": devices,
        }

    def _persist(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self._persist_state(record)
        self.persist_seconds = time.perf_counter() - t0

    def _persist_state(self, record: dict[str, Any]) -> None:
        self.store.put_blob("global_state", encode_tensors(self.model.state, "fp32"))
        self.store.put_blob("strategy_tensors", encode_tensors(self.model.owned, "fp32"))
        self.store.put_json("strategy_state", self.strategy.state_dict())
        self.store.put_json("defences_state", self.defences.state_dict())
        self.store.put_json("load_window", self.window.state_dict())
        self.store.put_json("assigned_window", self.assigned_window.state_dict())
        self.store.put_json("previous_assignment", experts_by_device_to_json(self.previous))
        self.store.save_round(record)
        self.store.put_json("last_round", record["round"])
        self.store.delete("current_round")
        self.store.delete("closing_round")
        if record["status"] == "failed":  # kept for a post-mortem, never replayed
            self.store.move_prefix(f"inflight/{record['round']}/", f"quarantine/{record['round']}/")
        else:
            self.store.delete_prefix(f"inflight/{record['round']}/")

    def restore(self, open_round: bool = True) -> None:
        """Load the persisted global state and strategy states (after a restart), and with
        ``open_round`` the round that was open with what it had accepted."""
        blob = self.store.get_blob("global_state")
        if blob is not None:
            self.model.set_state(decode_tensors(blob, 2**34, {k: (tuple(v.shape), v.dtype)
                                                               for k, v in self.model.state.items()}))
            log.info("resumed global state after round %d", self.completed)
        owned = self.store.get_blob("strategy_tensors")
        if owned is not None:
            self.model.set_owned(decode_tensors(owned, 2**34))
        state = self.store.get_json("strategy_state")
        if state is None:  # a store written before strategies were one object
            state = {"assignment": self.store.get_json("assignment_state", {}),
                     "aggregation": self.store.get_json("aggregation_state", {})}
        self.strategy.load_state_dict(state)
        self.defences.load_state_dict(self.store.get_json("defences_state", {}))
        if open_round:
            self._restore_round()

    def _restore_round(self) -> None:
        """Rebuild the round that was open when the aggregator stopped, with the acks,
        updates and statistics it had accepted (each validated again)."""
        cur = self.store.get_json("current_round")
        if cur is None:
            return
        if cur["number"] != self.completed + 1:
            log.warning("discarding stored in-flight round %s (last closed round is %d)", cur["number"],
                        self.completed)
            self.store.delete("current_round")
            self.store.delete_prefix(f"inflight/{cur['number']}/")
            return
        rnd = self.round_from_json(cur)
        if self.coordinator is not None:  # a coordinator that died after fencing it applied nothing
            self.coordinator.unfence(rnd.number)
        prefix = f"inflight/{rnd.number}/"
        for d in rnd.selected:
            blob = self.store.get_blob(f"{prefix}tensors/{d}")
            if blob is not None:
                rnd.tensors[d] = decode_tensors(blob, 2**34)
        for d in rnd.selected:
            ack = self.store.get_json(f"{prefix}ack/{d}")
            if ack is not None:
                rnd.acks[d] = Ack.model_validate(ack)
            st = self.store.get_json(f"{prefix}stats/{d}")
            dev = self.registry.get(d)
            if st is not None:
                # Accepted before a restart, possibly by an older version with looser bounds: checked again, so
                # statistics that could not be accepted now are dropped rather than crash every restart.
                try:
                    stats = Stats.model_validate(st)
                    problem = None if dev is None else self.stats_problem(rnd, d, stats)
                except ValidationError as e:
                    problem = f"invalid: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
                if problem:
                    log.warning("round %d: dropped the stored stats of %s: %s", rnd.number, d, problem)
                    rnd.rejected[d] = problem
                    self.store.delete(f"{prefix}stats/{d}")
                else:
                    rnd.stats[d] = stats
            data = None if self.coordinator is not None else self.store.get_blob(f"{prefix}update/{d}")
            if data is not None and dev is not None:  # a coordinator learns the workers' updates by sync()
                try:
                    rnd.updates[d] = (sha256_hex(data), self.decode_update(d, rnd.selected[d], data))
                except Exception as e:  # decodable once, not now (a strategy's sent state changed): drop, not crash
                    log.warning("round %d: dropped the stored update of %s: %s", rnd.number, d, e)
                    rnd.rejected[d] = f"stored update no longer decodes: {type(e).__name__}: {e}"[:500]
                    self.store.delete(f"{prefix}update/{d}")
        self.current = rnd
        closing = self.store.get_json("closing_round", {})
        if closing.get("round") == rnd.number and closing.get("attempts", 0) >= MAX_CLOSE_ATTEMPTS:
            # The process died while closing this round, more than once: something in it (a message that
            # exhausts memory, a native crash) kills the aggregator. Fail it instead of dying again.
            log.error("round %d: the aggregator stopped %d times while closing it; failing it and quarantining "
                      "its messages", rnd.number, closing["attempts"])
            self._fail(rnd, f"the aggregator stopped {closing['attempts']} times while closing this round")
            return
        log.info("resumed round %d: %d selected, %d updates and %d stats already accepted", rnd.number,
                 len(rnd.selected), len(rnd.updates), len(rnd.stats))

    @staticmethod
    def round_from_json(cur: dict[str, Any]) -> _Round:
        """The open round as stored under ``current_round`` (selection, deadline, plan), without
        the messages accepted in it. Raises KeyError or pydantic.ValidationError when ill-formed."""
        return _Round(cur["number"], cur["started"], cur["deadline"], experts_by_device_from_json(cur["selected"]),
                      cur.get("plan_info", {}), cur.get("assignment_seconds", 0.0), train=cur.get("train", {}),
                      attempts={d: int(a) for d, a in cur.get("attempts", {}).items()},
                      excluded=cur.get("excluded", {}),
                      objectives={d: [Objective.model_validate(o) for o in x]
                                  for d, x in cur.get("objectives", {}).items()},
                      sample_cap=cur.get("sample_cap"))

    MAX_RESENDS = 3

    def resend_unacked(self, now: float | None = None) -> int:
        """Send the open round's assignment again (same round and attempt, a new state
        transfer) to each selected device that has not acknowledged it nor finished
        ``assignment_resend_s`` after it was last sent, at most :attr:`MAX_RESENDS` times a
        round. On a cluster devices take their downlink at QoS 0 (``EdgeClient.downlink_qos``),
        so an assignment or its state can be lost while a device moves between nodes; a
        device acknowledges only once it has the state (PROTOCOL.md §4.2). ``now``: Unix
        seconds (default: the clock). Returns how many were sent."""
        every, rnd = self.settings.assignment_resend_s, self.current
        if not every or rnd is None:
            return 0
        now = time.time() if now is None else now
        due = [d for d in rnd.selected if d not in rnd.acks and not rnd.finished(d)
               and rnd.resends.get(d, 0) < self.MAX_RESENDS and now - rnd.sent.get(d, now) >= every
               and self.registry.get(d) is not None]
        for d in due:
            rnd.resends[d] = rnd.resends.get(d, 0) + 1
            self._send_assignment(rnd, d, rnd.selected[d])
        if due:
            log.info("round %d: re-sent %d unacknowledged assignments", rnd.number, len(due))
        return len(due)

    def resend_assignments(self) -> int:
        """Send the open round's assignment again to every selected device that has not
        reported (after a restart; devices ignore an assignment they already have).

        Returns:
            How many assignments were sent.
        """
        rnd = self.current
        if rnd is None:
            return 0
        n = 0
        for d, experts in rnd.selected.items():
            if not rnd.finished(d) and self.registry.get(d) is not None:
                self._send_assignment(rnd, d, experts)
                n += 1
        return n


class _Refused(Exception):
    """The pre-commit guard refused a round's new global state."""


_DTYPE_NAMES = {t: name for name, t in EXTRA_DTYPES.items()}
"""Torch dtype of an extra tensor -> its ``TensorSpec.dtype``."""
_EXTRA_NAME = TypeAdapter(ExtraName)
MAX_EXTRA_TENSOR_BYTES = 64 * 1024**2
"""Largest total size of one device's extra tensors in a round, in bytes."""


def _tensors_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why a plan's extra tensors for one device cannot be sent, or None: each name is a
    ``namespace.name`` outside the adapter state's namespaces, each tensor float32 or
    int64 and finite, at most :data:`MAX_EXTRA_TENSOR_BYTES` in all."""
    total = 0
    for name, t in tensors.items():
        try:
            _EXTRA_NAME.validate_python(name)
        except ValidationError:
            return f"extra tensor name {name!r} is not 'namespace.name' (lower-case namespace)"
        if name.split(".", 1)[0] in ("backbone", "expert", "router", "head"):
            return f"extra tensor name {name!r} uses an adapter-state namespace"
        problem = extra_tensor_problem(t)
        if problem:
            return f"extra tensor {name!r} {problem}"
        if t.dim() > 8:
            return f"extra tensor {name!r} has more than 8 dimensions"
        total += t.numel() * t.element_size()
    if total > MAX_EXTRA_TENSOR_BYTES:
        return f"extra tensors of {total} bytes exceed {MAX_EXTRA_TENSOR_BYTES}"
    return None


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it, else its ``str`` (plan info is free-form)."""
    import json

    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))
