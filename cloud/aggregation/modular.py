"""``modular`` (also accepted as ``fedmoe``, the name it had as FedMoE's aggregation):
modular aggregation (FedMoE, Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, Sec. 4 "modular aggregation";
docs/methods/fedmoe.md step 4).

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
from .base import AggregationStrategy, RoundSums


class Modular(AggregationStrategy):
    """FedMoE modular aggregation (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, Sec. 4): each tensor of the global
    state becomes the :meth:`weight`-weighted mean (fp64, cast back to its dtype) of the states of
    the results that hold it; unchanged when none holds it or the weights sum to <= 0."""

    name = "modular"
    aliases = ("fedmoe",)

    def weight(self, result: ClientResult, key: keys.Key) -> float:
        """Weight of ``result`` for a tensor of unit ``key.module``: |D_c|."""
        return float(result.num_samples)

    decomposes = True

    def fold(self, sums: RoundSums, result: ClientResult) -> None:
        """Add ``weight(result) * theta_c`` per tensor ``result`` holds (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, Sec. 4)."""
        sums.add_all([(name, t, self.weight(result, keys.parse(name))) for name, t in result.state.items()])
        sums.devices += 1

    def finish(self, global_state: dict[str, torch.Tensor], sums: RoundSums) -> dict[str, torch.Tensor]:
        """Each tensor's weighted mean ``sums.weighted / sums.weight``, cast to its dtype; unchanged
        where no update held it or its weights sum to <= 0."""
        out = dict(global_state)
        for name, current in global_state.items():
            total = sums.weight.get(name, 0.0)
            if total > 0:
                out[name] = (sums.weighted[name] / total).to(current.dtype)
        return out

    def aggregate(
        self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult], failures: list[Failure]
    ) -> dict[str, torch.Tensor]:
        sums = RoundSums()
        for r in results:
            self.fold(sums, r)
        return self.finish(global_state, sums)
