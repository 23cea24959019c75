"""The aggregation-strategy interface."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from ..strategy import ClientResult, Failure, Registered


class AggregationStrategy(Registered):
    """Maps (global adapter state, accepted updates) to the next global adapter state.

    Args:
        **params: strategy-specific settings from the config.
    """

    _registry: ClassVar[dict[str, type]] = {}
    _package: ClassVar[str] = "cloud.aggregation"

    def __init__(self, **params: Any):
        if params:
            raise TypeError(f"{type(self).__name__} got unknown parameters {sorted(params)}")

    @abstractmethod
    def aggregate(
        self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult], failures: list[Failure]
    ) -> dict[str, torch.Tensor]:
        """The next global adapter state (same keys and shapes as ``global_state``).
        Keys no result holds stay unchanged."""


def get_aggregation(name: str) -> type[AggregationStrategy]:
    """The aggregation strategy class registered as ``name``. Raises KeyError."""
    return AggregationStrategy.lookup(name)
