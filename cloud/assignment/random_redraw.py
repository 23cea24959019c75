"""``random_redraw`` (formerly ``random``, still accepted): the Random baseline of FLEX-MoE
(Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070, "Baselines").

Each device gets, per layer, ``k_c`` experts drawn uniformly at random, redrawn every
round (seeded by ``(seed, device, round)``), with the same capacities as ``flex`` and
``greedy``. (``random_kept`` is FedMoE's variant that keeps its draw.)
"""

from __future__ import annotations

from typing import Any

from .random_kept import RandomMoE


class RandomAssignment(RandomMoE):
    """FLEX-MoE's Random baseline (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070, "Baselines"): :class:`RandomMoE` with
    ``resample=True``, ``min(capacity, E)`` experts per layer redrawn every round."""

    name = "random_redraw"
    aliases = ("random",)

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, resample: bool = True, **params: Any):
        super().__init__(layers, num_experts, seed, resample=resample, **params)
