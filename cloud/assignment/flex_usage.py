"""``flex_usage``: FLEX-MoE's assignment with the load deficit driven by observed usage
(Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 14-19; issue 15).

:class:`~.flex.Flex` computes the deviation of eq. 14 from the data volume it
*assigned* to each expert, ``W_e = sum_{c holds e} |D_c|``. Its load-balance measure
(eq. 8) counts the tokens each expert was *routed*. Where the routers prefer a few of the
experts a device holds, a perfectly balanced assignment still leaves the usage unbalanced,
and nothing in eq. 14-19 sees it.

Here, after each round, the deviation uses the usage the devices reported instead
(``LayerStats.usage``, tokens routed to e, top-k counted, summed over the accepted
updates), rescaled to the assigned volume's total so that ``tau`` keeps its meaning::

    W'_e = (1 - w) W_e + w · U_e · (sum_e W_e / sum_e U_e)     w = usage_weight
    d_e  = W'_e - tau                                          (eq. 14 on W')

and eq. 15-19 go on unchanged: an expert the routers over-use gets a lower target next
round (fewer holders), an under-used one a higher target. A round without reported usage
keeps the assigned volume.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..strategy import ClientResult, Failure
from .flex import Flex


class FlexUsage(Flex):
    """FLEX-MoE with the usage-driven deficit (module docstring).

    Params: those of :class:`~.flex.Flex`, plus ``usage_weight`` w in [0, 1] (default
    1: usage only; 0 is plain ``flex``).

    Raises:
        ValueError: ``usage_weight`` outside [0, 1], or what :class:`~.flex.Flex` raises.
    """

    name = "flex_usage"

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, usage_weight: float = 1.0,
                 **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        if not 0.0 <= float(usage_weight) <= 1.0:
            raise ValueError(f"usage_weight must be in [0, 1], got {usage_weight!r}")
        self.usage_weight = float(usage_weight)

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        """Update the fitness (as ``flex``) and replace each layer's last assigned volume by
        the usage-weighted one ``W'`` (tokens ``(E,)`` rescaled to samples)."""
        super().observe(round, results, failures)
        for layer, lb in self.loads.items():
            if lb.last_load is None:
                continue
            usage = np.zeros(self.num_experts)
            for r in results:
                for ls in r.stats.layers:
                    if ls.layer == layer and len(ls.usage) == self.num_experts:
                        usage += np.asarray(ls.usage, dtype=np.float64)
            if usage.sum() <= 0:
                continue
            scaled = usage * (lb.last_load.sum() / usage.sum())
            lb.last_load = (1 - self.usage_weight) * lb.last_load + self.usage_weight * scaled
