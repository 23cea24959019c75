"""``full``: every device holds every expert (FedAvg of the full MoE; docs/methods/baselines.md).

The memory and traffic upper bound. A device whose budget cannot hold the full MoE
(capacity < E) is left out of the round, and the plan records it.
"""

from __future__ import annotations

from ..strategy import DeviceView, Plan
from .base import AssignmentStrategy


class FullMoE(AssignmentStrategy):
    """Every device with ``capacity >= E`` gets all E experts of every layer; the others are
    excluded (``Plan.excluded``, reason in words) and listed under ``left_out_budget``."""

    name = "full"

    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        everything = {layer: list(range(self.num_experts)) for layer in self.layers}
        fits = [d.device_id for d in devices if d.capacity >= self.num_experts]
        why = {d.device_id: f"the 'full' assignment needs all {self.num_experts} experts per layer; its budget holds "
                            f"{d.capacity}" for d in devices if d.capacity < self.num_experts}
        left_out = sorted(why)
        return Plan({d: everything for d in fits}, {"left_out_budget": left_out} if left_out else {}, excluded=why)
