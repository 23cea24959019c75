"""The defences the round engine applies, built from the aggregator's ``defences`` config.

Order within a round (docs/architecture.md data flow, step 5):

1. protocol bounds (schemas, ``max_samples_per_device``, hello/stats checks: before a
   message is accepted, in :mod:`cloud.rounds`);
2. :class:`cloud.robust.screening.UpdateScreen` on the round's accepted updates;
3. the configured aggregation, wrapped by a robust rule
   (:class:`cloud.robust.rules.RobustAggregation`) or replaced by DP-FedAvg
   (:class:`cloud.robust.dp.DPFedAvg`);
4. :class:`cloud.robust.guard.StepGuard` before the new state is committed.
"""

from __future__ import annotations

from typing import Any

import torch

from ..aggregation.base import AggregationStrategy
from ..strategy import ClientResult
from .config import DefenceConfig
from .guard import StepGuard
from .screening import Screened, UpdateScreen


class Defences:
    """Screening, the aggregation wrapper and the pre-commit guard of one federation.

    Args:
        config: the ``defences`` section (defaults: screening and guard on, no robust
            rule, no differential privacy).
    """

    def __init__(self, config: DefenceConfig | None = None):
        self.config = config or DefenceConfig()
        c = self.config
        self.screen = UpdateScreen(c.screening, c.min_holders) if c.screening is not None else None
        self.guard = StepGuard(c.guard)

    def wrap(self, aggregation: AggregationStrategy) -> AggregationStrategy:
        """``aggregation`` wrapped by the configured robust rule, or DP-FedAvg in its place.

        Raises:
            ImportError: ``dp`` is configured but the accountant is not installed.
        """
        c = self.config
        if c.dp is not None:
            from .dp import DPFedAvg

            return DPFedAvg(c.dp.noise_multiplier, c.dp.clip_norm, delta=c.dp.delta,
                            sampling_rate=c.dp.sampling_rate, seed=c.dp.seed)
        if c.robust.name != "none":
            from .rules import RobustAggregation

            return RobustAggregation(aggregation, c.robust.name, **c.robust.params)
        return aggregation

    def screen_round(self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult]) -> Screened:
        """Screen the round's accepted results (unchanged when screening is off)."""
        if self.screen is None:
            return Screened(list(results))
        return self.screen.screen(round, global_state, results)

    @property
    def streamable(self) -> bool:
        """Whether screening can run on each update alone as it arrives (aggregator workers,
        :meth:`screen_update`): not when experts with few holders are damped
        (``min_holders`` > 1 needs the round's holders)."""
        return self.screen is None or self.screen.min_holders <= 1

    def screen_update(self, round: int, global_state: dict[str, torch.Tensor], result: ClientResult,
                      sample_cap: int | None = None) -> Screened:
        """Screen one update as it arrives, against the reference norms of the rounds before
        (an aggregator worker's streaming screening; rejection and clipping as in
        :meth:`screen_round`). The round's median of claimed samples is not known yet, so
        ``sample_cap`` (:meth:`round_sample_cap`, set when the round started) caps the claim
        instead; None: no cap (``max_samples_per_device`` and the device's declared samples
        still bound its weight)."""
        if self.screen is None:
            return Screened([result])
        return self.screen.screen(round, global_state, [result], references=dict(self.screen.references),
                                  sample_cap=sample_cap)

    def round_sample_cap(self, declared: list[int]) -> int | None:
        """The sample cap for a round screened update by update (aggregator workers):
        ``sample_cap_factor`` x the median of the selected devices' declared ``num_samples``
        (their hellos; a claim in ``Stats`` may not exceed the declared count). None when
        screening is off or nobody was selected."""
        if self.screen is None or not declared:
            return None
        return self.screen.sample_cap(declared)

    def state_dict(self) -> dict[str, Any]:
        """JSON state kept between rounds (screening references, guard history)."""
        return {"screening": self.screen.state_dict() if self.screen else {}, "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if self.screen is not None:
            self.screen.load_state_dict(state.get("screening", {}))
        self.guard.load_state_dict(state.get("guard", {}))
