"""``usage_weighted``: FLEX-MoE aggregation (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 3-4; docs/methods/flex-moe.md).

- Backbone (and each task head over its own task's devices) by |D_c|-weighted FedAvg
  of the participants' states (eq. 3).
- Expert e of layer l (with its router row) by the mean of its holders' states weighted
  by their usage counts ``u[c,l,e]`` (training tokens routed to e, eq. 4); zero total
  usage leaves the expert unchanged this round.

Averaging the states with weights summing to one equals applying the weighted mean of
the updates ``Δθ`` to the previous global state, as eq. 3-4 write it.
"""

from __future__ import annotations

from protocol import keys

from ..strategy import ClientResult
from .modular import Modular


class UsageWeighted(Modular):
    """FLEX-MoE aggregation (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 3-4): :class:`Modular` with expert
    tensors and router rows weighted by usage ``u[c,l,e]`` (tokens), the rest by |D_c| (samples)."""

    name = "usage_weighted"

    def weight(self, result: ClientResult, key: keys.Key) -> float:
        """|D_c| for the backbone and heads; ``u[c,l,e]`` for expert tensors and router rows."""
        if key.group not in ("expert", "router"):
            return float(result.num_samples)
        if result.stats is None:
            return 0.0
        for ls in result.stats.layers:
            if ls.layer == key.layer:
                return float(ls.usage[key.expert])
        return 0.0
