"""The round engine: a coordinator that wires its parts (one module each, see
:mod:`cloud.rounds`) and opens each round."""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable, Sequence

from protocol.experts import experts_by_device_from_json
from protocol.logsafe import LogLimiter
from protocol.topics import Topics

from ..filters import InboundFilter, UpdateDecoding
from ..global_model import GlobalModel
from ..metrics import LoadWindow
from ..registry import Registry
from ..robust.defences import Defences
from ..store import Store
from ..strategies.base import Strategy
from ..strategy import Experts
from ..workers import Coordinator
from .closing import Closing
from .dispatch import Dispatch, StateBlobs
from .eligibility import Eligibility
from .intake import Intake
from .plan import PlanChecks
from .recovery import Recovery
from .state import OpenRound, RoundSettings, Wire
from .streaming import Streaming

log = logging.getLogger(__name__)


class RoundEngine(Eligibility, PlanChecks, Dispatch, Intake, Streaming, Closing, Recovery):
    """Drives rounds. The service opens one with :meth:`start_round`, feeds it validated
    messages (:meth:`on_ack`, :meth:`on_update`, :meth:`on_stats`), re-sends what was not
    acknowledged (:meth:`resend_unacked`) until :meth:`should_close`, then calls
    :meth:`close_round`; after a restart :meth:`restore` and :meth:`resend_assignments`.

    Args:
        model: the global model.
        registry: registered devices.
        store: durable state.
        strategy: the federated method (:class:`cloud.strategies.Strategy`), used as given:
            whoever builds it wraps its aggregation part in the defences' robust rule or
            DP-FedAvg (:func:`cloud.service.build_strategy`).
        wire: publishing side of the transport.
        topics: the federation's topics.
        settings: round settings.
        eval_data: task -> test items ``(input, label id)``.
        reject: ``(device_id, round, reason, *, kind=None, upload_id=None)`` -> reply to a device (the
            message kind and update transfer id it refers to, where known).
        progress: ``(event, round, detail)`` -> operator progress.
        defences: update screening, the sample cap and the pre-commit guard
            (:mod:`cloud.robust`); default: screening and guard on.
        filters: the incoming filters decoded updates pass (:mod:`cloud.filters`);
            default: ``[UpdateDecoding()]``.
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
        self.wire, self.topics, self.settings = wire, topics, settings
        self.eval_data = eval_data
        self.reject, self.progress = reject, progress
        self.current: OpenRound | None = None
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
        self.between_sends: Callable[[], None] | None = None
        """Called between two assignments as a round opens (the service takes in what devices
        sent meanwhile: with 1,000 devices the sending took 30-50 s, in which uploads of the
        devices served first only queued)."""
        self.programs = None
        """The training programs served to devices that train with one
        (:class:`cloud.programs.ProgramPublisher`; the service sets it where ``shard_url`` is
        configured)."""
        self._notice_log = LogLimiter(log, "failed notices", per_key=3, total=10, interval_s=60.0)
        """Failed notice publishes are logged rate-limited (a broker outage must not flood the log)."""
        self._state_blobs = StateBlobs()
        """Encoded adapter states sent this round, by content (devices sent the same state share one)."""
        self.plan_error: str | None = None
        """Why the strategy could not configure the waiting round (it raised), if so."""
        self.persist_seconds: float | None = None
        """How long persisting the last closed round took (seconds)."""
        self.coordinator: Coordinator | None = None
        """Set when aggregator workers take the uploads (``--role coordinator``): the engine
        learns what they took from the store (:meth:`sync`) and closes from their sums."""

    def evaluate(self) -> dict[str, Any]:
        """The strategy's evaluation of the global model now (:meth:`Strategy.evaluate`):
        ``accuracy``/``loss`` (sample-weighted means over tasks) and ``per_task``."""
        return self.strategy.evaluate(self.completed, self.model, self.eval_data, self.settings.eval_batch_size)

    def _prepare_programs(self, plan) -> None:
        """Export the training programs the plan's program devices need (protocol minor 12)
        before the round opens, so that an export (tens of seconds, more on a loaded machine)
        does not eat into the round's deadline for every device; a failure is reported when
        the device's assignment is sent (:meth:`_send_assignment`)."""
        if self.programs is None:
            return
        for d, experts in plan.assignments.items():
            dev = self.registry.get(d)
            if dev is not None and dev.runtimes:
                try:
                    self._program_for(dev, experts, self._train_for_overrides(plan.train.get(d)))
                except Exception:  # noqa: BLE001 (said with the device's assignment)
                    pass

    def start_round(self) -> bool:
        """Select, assign and publish round ``completed + 1``.

        Returns:
            False if no eligible device got an assignment (nothing was published).
        """
        number = self.completed + 1
        eligible, excluded = self._eligible()
        chosen = self._sample(number, eligible)
        if chosen is None:
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
        self._finish_plan(number, plan, views, excluded)
        self._tell_excluded(number, excluded)
        if not plan.assignments:
            if number != self._idle_round:
                self._idle_round = number
                log.warning("round %d: no device could be assigned (eligible: %s, capacities %s); waiting", number,
                            [d.device_id for d in eligible], {v.device_id: v.capacity for v in views})
            return False
        self._prepare_programs(plan)
        now = time.time()  # the round's deadline counts from here, after any program export
        rnd = OpenRound(number, now, now + self.settings.round_timeout_s,
                        {d: Experts(e) for d, e in plan.assignments.items()},
                        plan.info, seconds, excluded=dict(self.excluded),
                        offline=[d.device_id for d in self.registry.offline()])
        rnd.train = {d: t for d, t in plan.train.items() if d in rnd.selected}
        rnd.objectives = {d: list(o) for d, o in plan.objectives.items() if d in rnd.selected and o}
        rnd.tensors = {d: {k: t.detach().clone() for k, t in x.items()}
                       for d, x in plan.tensors.items() if d in rnd.selected and x}
        rnd.ranks = {d: r for d, e in rnd.selected.items()
                     if (dev := self.registry.get(d)) is not None and (r := self.rank_for(dev, e)) is not None}
        if self.coordinator is None and self.streams():
            self.open_stream(rnd)
        if self.coordinator is not None or rnd.stream is not None:  # screened update by update: the cap now
            rnd.sample_cap = self.defences.round_sample_cap(
                [dev.num_samples for d in rnd.selected if (dev := self.registry.get(d)) is not None])
        self.current = rnd
        self._save_open_round(rnd)
        for device_id in list(rnd.selected):
            self._send_assignment(rnd, device_id, rnd.selected[device_id])
            if self.between_sends is not None:
                self.between_sends()
        log.info("round %d: %d devices assigned (%s, %.3f s)", number, len(rnd.selected), self.strategy.label,
                 seconds)
        self.progress("round_start", number, {"devices": sorted(rnd.selected), "assignment_seconds": seconds,
                                              "excluded": rnd.excluded,
                                              "offline": rnd.offline})
        return True
