"""Aggregation strategies, one module per strategy, selected by ``name`` in the config."""

from .base import AggregationStrategy, get_aggregation

__all__ = ["AggregationStrategy", "get_aggregation"]
