"""``random_kept`` (formerly ``random_moe``, still accepted): the randomMoE baseline
(FedMoE, Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304; docs/methods/fedmoe.md).

Each device gets, per layer, ``capacity`` experts drawn uniformly at random. The draw
is kept across rounds (so its base shards stay cached): each device has one random order
of the experts per layer and holds its first ``capacity``, so a device whose capacity
shrinks keeps a subset of what it held and one whose capacity grows keeps all of it
(each prefix is still a uniform draw). ``resample: true`` draws a fresh order every round
(then it is ``random_redraw``). ``random_same_size`` draws as many experts as FedMoE
would give.
"""

from __future__ import annotations

import random
from typing import Any

from ..strategy import DeviceView, Experts, Plan
from .base import AssignmentStrategy


class RandomMoE(AssignmentStrategy):
    """randomMoE (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304): per layer the first ``min(capacity, E)`` experts
    of a uniformly random order (``random.Random`` seeded by seed and device; also by the
    round when ``resample``), so draws are nested across capacities. Devices with
    capacity < 1 are left out of the plan. Stateless (the order is recomputed)."""

    name = "random_kept"
    aliases = ("random_moe",)

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, resample: bool = False, **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        self.resample = resample

    def order(self, device_id: str, round: int) -> dict[int, list[int]]:
        """Layer -> the device's random order of all ``E`` experts (its draw is a prefix)."""
        rng = random.Random(f"{self.seed}/{device_id}" + (f"/{round}" if self.resample else ""))
        return {layer: rng.sample(range(self.num_experts), self.num_experts) for layer in self.layers}

    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        out: dict[str, Experts] = {}
        for d in devices:
            k = min(d.capacity, self.num_experts)
            if k >= 1:
                out[d.device_id] = {layer: sorted(o[:k]) for layer, o in self.order(d.device_id, round).items()}
        return Plan(out)
