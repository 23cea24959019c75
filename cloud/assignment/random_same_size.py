"""``random_same_size`` (formerly ``randommoe``, still accepted): FedMoE's randomMoE
baseline with sub-models of the *same sizes* (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, "Baselines";
docs/methods/fedmoe.md last line).

Every device goes through FedMoE's stage one (probe or estimate, then the θ search of
eq. 3, :mod:`.fedmoe`), so each layer gets the same number of experts FedMoE
would give it; the experts themselves are then drawn uniformly at random (seeded per
device and layer) and kept. No expert recommendation. This isolates *which* experts
FedMoE picks from *how many*. (``random_kept`` is the other random baseline: as many
experts as the budget holds.) The draw's seed string still says ``randommoe``, so runs
reproduce the draws made before the rename.
"""

from __future__ import annotations

import random
from typing import Any

from ..strategy import DeviceView, Experts, Plan
from .fedmoe import FedMoE


class RandomSameSize(FedMoE):
    """FedMoE's stage one (per-layer expert counts, Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304 eq. 3) without stage two:
    when stage one sizes a device without a final map (not a probe round), that many experts per
    layer are drawn uniformly at random (seeded per device) and kept. Params as :class:`FedMoE`
    (``stage2`` defaults to False)."""

    name = "random_same_size"
    aliases = ("randommoe",)

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, **params: Any):
        params.setdefault("stage2", False)
        super().__init__(layers, num_experts, seed, **params)

    def _stage_one(self, d: DeviceView, memory, plan: Plan) -> Experts | None:
        had = d.device_id in self.map and d.device_id not in self.provisional
        experts = super()._stage_one(d, memory, plan)
        if experts is None or had or d.device_id in self._probing:
            return experts
        rng = random.Random(f"{self.seed}/{d.device_id}/randommoe")  # the former name: same draws as before
        drawn = {layer: sorted(rng.sample(range(self.num_experts), len(v))) for layer, v in experts.items()}
        self.map[d.device_id] = self.initial[d.device_id] = drawn
        return drawn
