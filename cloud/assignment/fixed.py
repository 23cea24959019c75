"""``fixed``: every device holds the same expert slots in every MoE layer.

The baselines of Fed-MoE (Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610, Sec. 5.1;
docs/methods/fed-moe-fusion.md) train one identical client model everywhere: FedAvg and FedProx of the
*compact* model (``experts: [0]``: one expert per layer is the dense model of the
expert's architecture) and Avg-MoE/FedMix (``experts: [0, 1]``: a 2-expert client MoE
whose experts and router rows are averaged). With the ``modular`` aggregation this is
FedAvg of exactly that model, on the same code path as every other method.
"""

from __future__ import annotations

from typing import Any

from ..strategy import DeviceView, Plan
from .base import AssignmentStrategy


class FixedExperts(AssignmentStrategy):
    """Every device with ``capacity >= len(experts)`` gets ``experts`` in every layer; the
    others are excluded with the reason (``Plan.excluded``).

    Params: ``experts`` (list of distinct expert ids in ``0..E-1``; default ``[0]``).

    Raises:
        ValueError: ``experts`` empty, repeated, or out of range.
    """

    name = "fixed"

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, experts: Any = (0,), **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        ids = list(experts) if isinstance(experts, (list, tuple)) else None
        if (not ids or any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num_experts for e in ids)
                or len(set(ids)) != len(ids)):
            raise ValueError(f"fixed: experts must be a non-empty list of distinct ids in 0..{num_experts - 1}, "
                             f"got {experts!r}")
        self.experts = sorted(ids)

    def served_experts(self) -> dict[int, list[int]]:
        """The one sub-MoE every device holds: the cloud evaluates it, not the whole MoE."""
        return {layer: list(self.experts) for layer in self.layers}

    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        held = self.served_experts()
        need = len(self.experts)
        why = {d.device_id: f"the 'fixed' assignment gives {need} experts per layer; its budget holds {d.capacity}"
               for d in devices if d.capacity < need}
        return Plan({d.device_id: held for d in devices if d.device_id not in why}, excluded=why)
