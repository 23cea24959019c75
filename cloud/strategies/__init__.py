"""Federated methods as strategy objects (one per algorithm; see :mod:`cloud.strategy`)."""

from __future__ import annotations

from .base import Strategy, get_strategy
from .composed import Composed

__all__ = ["Composed", "Strategy", "get_strategy"]
