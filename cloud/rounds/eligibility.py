"""Eligibility: which online devices can take part in a round (task, weight format,
protocol version), which of them the round samples, and what each device's memory
budget holds (:class:`cloud.strategy.DeviceView`)."""

from __future__ import annotations

import logging
import math
import random
from typing import Callable

from moe_model.budget import DEFAULT_RUNTIME_BYTES, estimate, max_experts_per_layer
from moe_model.ranks import rank_ladder, spec_at_rank
from protocol.messages import MIN_MINOR_FOR_LORA_RANK, MIN_MINOR_FOR_UPLINK, ModelSpec

from ..strategy import DeviceView, Experts
from .state import EngineState

log = logging.getLogger(__name__)

Excluded = dict[str, tuple[str, dict[str, int]]]
"""device -> (why the round cannot use it, figures for its ``excluded`` notice)."""


class Eligibility(EngineState):
    """The round engine's device selection (a part of :class:`cloud.rounds.RoundEngine`)."""

    _rng: random.Random
    plan_error: str | None
    previous: dict[str, Experts]

    def _runtime(self, dev) -> int:
        return DEFAULT_RUNTIME_BYTES if dev.runtime_bytes is None else dev.runtime_bytes

    def format_for(self, dev) -> str:
        """The weight format ``dev`` gets: its first preference the cloud serves."""
        return self.model.format_for(dev.weight_formats) or self.model.weight_format

    @staticmethod
    def _may_lower_rank(dev) -> bool:
        """Whether ``dev`` can train a LoRA rank below the model's: it speaks minor 13, and it
        builds the model itself (a device training with a served program gets the program of
        the model's rank)."""
        return dev.protocol_minor >= MIN_MINOR_FOR_LORA_RANK and not dev.runtimes

    def _spec_for(self, dev) -> ModelSpec:
        """The model as ``dev``'s experts are chosen for: at ``min_lora_rank`` where the
        federation has heterogeneous ranks and the device can train one (minor 13)."""
        r = self.settings.min_lora_rank
        if r is None or not self._may_lower_rank(dev):
            return self.model.spec
        return spec_at_rank(self.model.spec, r)

    def capacity(self, dev) -> int:
        """Experts per layer ``dev``'s budget holds (0..E), at the lowest rank it may train."""
        labels = len(self.model.tasks.get(dev.task, [0, 1]))
        return max_experts_per_layer(self._spec_for(dev), dev.budget_bytes, self.settings.train.batch_size, labels,
                                     self._runtime(dev), self.format_for(dev))

    def memory_fn(self, dev) -> Callable[[Experts], int]:
        """``experts -> bytes`` ``dev`` needs for a round holding them (``moe_model.budget.plan``),
        at the lowest rank it may train."""
        return self._memory_at(dev, self._spec_for(dev))

    def _memory_at(self, dev, spec: ModelSpec) -> Callable[[Experts], int]:
        """``experts -> bytes`` ``dev`` needs for a round holding them with the model ``spec``."""
        labels = len(self.model.tasks.get(dev.task, [0, 1]))
        batch, runtime, fmt = self.settings.train.batch_size, self._runtime(dev), self.format_for(dev)
        return lambda experts: estimate(spec, experts, batch, labels, runtime, fmt).total

    def rank_for(self, dev, experts: Experts) -> int | None:
        """The LoRA rank ``dev`` trains holding ``experts``: the highest of
        ``moe_model.ranks.rank_ladder`` whose memory plan fits its budget (its experts were
        chosen at the lowest), None where that is the model's rank or ranks are not
        heterogeneous (``min_lora_rank``) or the device cannot train another
        (:meth:`_may_lower_rank`)."""
        spec, low = self.model.spec, self.settings.min_lora_rank
        if low is None or not self._may_lower_rank(dev):
            return None
        for r in rank_ladder(spec.lora.rank, low):
            if r == low or self._memory_at(dev, spec_at_rank(spec, r))(experts) <= dev.budget_bytes:
                return None if r == spec.lora.rank else r
        return None

    def _view(self, dev) -> DeviceView:
        """``dev`` (a registered device) as the strategy sees it."""
        return DeviceView(dev.device_id, dev.task, dev.num_samples, dev.budget_bytes, self.capacity(dev),
                          self.memory_fn(dev), self.registry.last_stats.get(dev.device_id),
                          self.previous.get(dev.device_id),
                          extra={"runtime_bytes": self._runtime(dev), "weight_format": self.format_for(dev)},
                          protocol_minor=dev.protocol_minor)

    def _eligible(self) -> tuple[list, Excluded]:
        """The online devices a round can use (sorted by id), and the others with why: an
        unknown task, no weight format the cloud serves, a training runtime it serves no
        program for, or (aggregator workers on a broker without shared subscriptions) an SDK
        too old to send to an uplink partition."""
        eligible, excluded = [], {}
        for dev in self.registry.online():
            if dev.task not in self.model.tasks:
                excluded[dev.device_id] = (f"unknown task {dev.task!r}; this federation trains "
                                           f"{sorted(self.model.tasks)}", {})
            elif self.model.format_for(dev.weight_formats) is None:
                excluded[dev.device_id] = (f"loads only {dev.weight_formats} shards; the cloud serves "
                                           f"{self.model.formats}", {})
            elif dev.runtimes and (why := self.programs.refuses(dev.runtimes) if self.programs is not None else
                                   f"trains with a served program ({', '.join(dev.runtimes)}) and this aggregator "
                                   "serves none: configure shard_url and shard_dir (the programs are files beside "
                                   "the shards)"):
                excluded[dev.device_id] = (why, {})
            elif self.coordinator is not None and not self.coordinator.shared_subscriptions \
                    and dev.protocol_minor < MIN_MINOR_FOR_UPLINK:
                excluded[dev.device_id] = (f"protocol minor {dev.protocol_minor} cannot send to an aggregator "
                                           f"worker's uplink partition (minor {MIN_MINOR_FOR_UPLINK}), and this "
                                           "MQTT 3.1.1 broker has no shared subscriptions: update the device SDK",
                                           {})
            else:
                eligible.append(dev)
        return sorted(eligible, key=lambda d: d.device_id), excluded

    def _sample(self, number: int, eligible: list) -> list | None:
        """The devices round ``number`` selects: ``clients_per_round`` of ``eligible``, picked
        by :meth:`Strategy.sample_devices` when fewer than all; None when the strategy
        failed (logged once, and :attr:`plan_error` says why)."""
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
                return None
        return chosen

    def _too_small(self, view: DeviceView) -> tuple[str, dict[str, int]]:
        """Why ``view``'s budget holds no expert per layer, with the figures."""
        need = view.memory({layer: [0] for layer in self.model.layers})
        runtime, fmt = view.extra["runtime_bytes"], view.extra["weight_format"]
        return (f"budget {view.budget_bytes / 2**20:.0f} MiB is below the {need / 2**20:.0f} MiB memory plan for one "
                f"expert per layer ({fmt}; runtime baseline {runtime / 2**20:.0f} MiB)",
                {"budget_bytes": view.budget_bytes, "needed_bytes": need, "runtime_bytes": runtime})
