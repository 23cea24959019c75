"""``greedy``: the Greedy top-k baseline of FLEX-MoE (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 20).

Each device takes, per layer, the ``k_c`` experts with the highest fitness Q in its
row (the same Q as ``flex``: eq. 5-7, :mod:`.fitness`), ignoring load balance. Exact
ties (e.g. every score still at Q_0) are broken at random from ``(seed, round)``; a
fixed lowest-index rule would pile every device onto experts 0..k-1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..strategy import ClientResult, DeviceView, Failure, Plan
from .base import AssignmentStrategy
from .fitness import Fitness, top_k_rows


class Greedy(AssignmentStrategy):
    """Params: ``indicator`` acc|loss, ``alpha_L`` 1.0, ``beta`` 0.1, ``q0`` 0.2."""

    name = "greedy"

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, indicator: str = "acc",
                 alpha_L: float = 1.0, beta: float = 0.1, q0: float = 0.2, **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        self.fitness = Fitness(layers, num_experts, indicator, alpha_L, beta, q0)

    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        devs = [d for d in devices if min(d.capacity, self.num_experts) >= 1]
        ids = [d.device_id for d in devs]
        k = np.array([min(d.capacity, self.num_experts) for d in devs], dtype=np.int64)
        rng = np.random.default_rng([self.seed, round])
        out: dict[str, dict[int, list[int]]] = {d: {} for d in ids}
        for layer in self.layers:
            x = top_k_rows(self.fitness.matrix(layer, ids), k, rng)
            for i, d in enumerate(ids):
                out[d][layer] = np.flatnonzero(x[i]).tolist()
        return Plan(out, {"status": "ok"})

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        self.fitness.update(results)

    def state_dict(self) -> dict[str, Any]:
        return {"fitness": self.fitness.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fitness.load_state_dict(state.get("fitness", {}))
