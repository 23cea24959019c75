"""``trimmed_mean`` (``trim``, default 0.1, ``0 <= trim < 0.5``): per coordinate, sort the
``n`` holders' values, drop ``k = max(1, floor(trim * n))`` from each end and average the
rest, unweighted (the median when ``2k >= n``). Yin, Chen, Ramchandran, Bartlett,
"Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import CoordinateRule
from .median import median


def trimmed_mean(stacked: torch.Tensor, trim: float) -> torch.Tensor:
    """Coordinate-wise trimmed mean over dim 0.

    Args:
        stacked: ``(n, *shape)``, ``n >= 1``, float.
        trim: ``0 <= trim < 0.5``; ``k = max(1, floor(trim * n))`` values are dropped
            from each end (the median when ``2k >= n``).

    Returns:
        ``(*shape)``: the mean of the ``n - 2k`` middle values of each coordinate.
    """
    n = stacked.shape[0]
    k = max(1, math.floor(trim * n))
    if 2 * k >= n:
        return median(stacked)
    return torch.sort(stacked, dim=0).values[k:n - k].mean(dim=0)


class TrimmedMean(CoordinateRule):
    """:func:`trimmed_mean` per coordinate (Yin et al., ICML 2018).

    Args:
        trim: share dropped at each end, ``0 <= trim < 0.5`` (default 0.1).

    Raises:
        ValueError: ``trim`` not a number in ``[0, 0.5)``, or another parameter.
    """

    name = "trimmed_mean"
    defaults = {"trim": 0.1}

    def __init__(self, **params: Any):
        super().__init__(**params)
        trim = self.params["trim"]
        if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0 <= trim < 0.5:
            raise ValueError(f"trimmed_mean: trim must be a number with 0 <= trim < 0.5, got {trim!r}")
        self.params["trim"] = float(trim)

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return trimmed_mean(stacked, self.params["trim"])
