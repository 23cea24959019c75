"""``modular`` (also accepted as ``fedmoe``, the name it had as FedMoE's aggregation):
modular aggregation (FedMoE, 003_a50797d291873d18.txt, Sec. 4 "modular aggregation";
ALGORITHMS.md §1 step 4).

Per aggregation unit (:attr:`protocol.keys.Key.module`): the backbone by FedAvg over
all participants, weights |D_c|; an expert together with its router row by FedAvg over
the participants that held it (unchanged when nobody held it; taken as is when one
did); a task head over the participants of that task only. With every device holding
every expert (``full`` assignment) this is plain FedAvg of the full MoE.

Subclasses change only :meth:`weight` (e.g. FLEX-MoE's usage weights).
"""

from __future__ import annotations

import torch

from protocol import keys

from ..strategy import ClientResult, Failure
from .base import AggregationStrategy


class Modular(AggregationStrategy):
    """FedMoE modular aggregation (003_a50797d291873d18.txt, Sec. 4): each tensor of the global
    state becomes the :meth:`weight`-weighted mean (fp64, cast back to its dtype) of the states of
    the results that hold it; unchanged when none holds it or the weights sum to <= 0."""

    name = "modular"
    aliases = ("fedmoe",)

    def weight(self, result: ClientResult, key: keys.Key) -> float:
        """Weight of ``result`` for a tensor of unit ``key.module``: |D_c|."""
        return float(result.num_samples)

    def aggregate(
        self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult], failures: list[Failure]
    ) -> dict[str, torch.Tensor]:
        out = dict(global_state)
        for name, current in global_state.items():
            key = keys.parse(name)
            holders = [r for r in results if name in r.state]
            weights = [self.weight(r, key) for r in holders]
            total = sum(weights)
            if not holders or total <= 0:
                continue
            acc = torch.zeros_like(current, dtype=torch.float64)
            for r, w in zip(holders, weights):
                acc += (w / total) * r.state[name].to(torch.float64)
            out[name] = acc.to(current.dtype)
        return out
