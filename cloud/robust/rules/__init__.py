"""Byzantine-robust aggregation rules (README "Poisoned updates"), one module per rule.

:class:`RobustAggregation` applies a rule per aggregation unit around the configured
aggregation strategy (:mod:`.robust_aggregation`); a rule is a :class:`RobustRule`
subclass with a ``name`` (:mod:`.base`), selected by the aggregator's
``defences: {robust: {name: ..., params: {...}}}``. Built in: ``median``
(:mod:`.median`), ``trimmed_mean`` (:mod:`.trimmed_mean`), ``multi_krum``
(:mod:`.multi_krum`); third-party rules register under the entry-point group
``fedmoe.robust_rules`` (docs/extending.md).
"""

from __future__ import annotations

from .base import CoordinateRule, RobustRule, SelectionRule, get_robust_rule
from .median import median
from .multi_krum import krum_scores, multi_krum_select, squared_distances
from .robust_aggregation import RobustAggregation
from .trimmed_mean import trimmed_mean

__all__ = ["CoordinateRule", "RobustAggregation", "RobustRule", "SelectionRule", "get_robust_rule",
           "krum_scores", "median", "multi_krum_select", "squared_distances", "trimmed_mean"]
