"""``random_kept`` (formerly ``random_moe``, still accepted): the randomMoE baseline
(FedMoE, 003_a50797d291873d18.txt; ALGORITHMS.md §1).

Each device gets, per layer, ``capacity`` experts drawn uniformly at random. The draw
is kept while the device's capacity stays the same (so its base shards stay cached),
unless ``resample: true`` asks for a fresh draw every round (then it is
``random_redraw``). ``random_same_size`` draws as many experts as FedMoE would give.
"""

from __future__ import annotations

import random
from typing import Any

from protocol.experts import experts_by_device_from_json, experts_by_device_to_json

from ..strategy import DeviceView, Experts, Plan
from .base import AssignmentStrategy


class RandomMoE(AssignmentStrategy):
    """randomMoE (003_a50797d291873d18.txt): per layer ``min(capacity, E)`` experts drawn uniformly
    (``random.Random`` seeded by seed, device and the count; by the round when ``resample``), kept
    while the count stays the same. Devices with capacity < 1 are left out of the plan.
    State: the kept draws."""

    name = "random_kept"
    aliases = ("random_moe",)

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, resample: bool = False, **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        self.resample = resample
        self._kept: dict[str, Experts] = {}

    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        out: dict[str, Experts] = {}
        for d in devices:
            k = min(d.capacity, self.num_experts)
            if k < 1:
                continue
            kept = self._kept.get(d.device_id)
            if self.resample or kept is None or any(len(v) != k for v in kept.values()):
                rng = random.Random(f"{self.seed}/{d.device_id}/{round if self.resample else k}")
                kept = {layer: sorted(rng.sample(range(self.num_experts), k)) for layer in self.layers}
                self._kept[d.device_id] = kept
            out[d.device_id] = kept
        return Plan(out)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": experts_by_device_to_json(self._kept)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kept = experts_by_device_from_json(state.get("kept", {}))
