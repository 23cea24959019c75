"""``fedmoe``: FedMoE's modular aggregation (003_a50797d291873d18.txt, "Modular
Aggregation"; ALGORITHMS.md §1 step 4), the aggregation half of the ``fedmoe`` strategy.

It is :class:`.modular.Modular` unchanged: the backbone by |D_c|-weighted FedAvg over
all participants; an expert *and its router row* (one aggregation unit,
:attr:`protocol.keys.Key.module`) by FedAvg over its holders, taken as is from a single
holder, unchanged without one; each task's head only over devices of that task.
"""

from __future__ import annotations

from .modular import Modular


class FedMoEAggregation(Modular):
    name = "fedmoe"
