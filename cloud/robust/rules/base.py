"""The robust-rule interface: what one module in this package implements.

A rule is a :class:`CoordinateRule` (a statistic over the holders' tensors, coordinate
by coordinate: the median, the trimmed mean) or a :class:`SelectionRule` (which holders
of a unit to keep; the wrapped aggregation strategy then aggregates over them, with its
own weights: Multi-Krum). :class:`~.robust_aggregation.RobustAggregation` applies it per
aggregation unit. A subclass with a ``name`` registers itself
(:class:`protocol.plugins.Registered`); the configuration selects it as
``defences: {robust: {name: ..., params: {...}}}``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from protocol.plugins import Registered, Registry


class RobustRule(Registered):
    """One Byzantine-robust aggregation rule, with its parameters checked.

    Subclasses declare their parameters and defaults in :attr:`defaults` and check the
    values by overriding ``__init__`` (call ``super().__init__(**params)`` first, then read
    and normalise ``self.params``).

    Args:
        **params: the rule's parameters (``defences.robust.params``); a missing one takes
            its default.

    Raises:
        ValueError: a parameter the rule does not take (the message lists those it does),
            or (subclasses) an invalid value.

    Attributes:
        params: every parameter of the rule, defaults filled in (JSON-serialisable: it
            goes into the round record's ``robust`` report).
    """

    registry: ClassVar[Registry] = Registry("robust aggregation rule", "fedmoe.robust_rules", "cloud.robust.rules")
    defaults: ClassVar[dict[str, Any]] = {}
    """Parameter name -> default value."""

    def __init__(self, **params: Any):
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(f"robust rule {self.name!r} got unknown parameters {unknown}; "
                             f"it takes {sorted(self.defaults) or 'none'}")
        self.params: dict[str, Any] = {**self.defaults, **params}

    def min_holders(self) -> int:
        """Holders a unit needs for the rule to apply (default 3: a median of one or two
        values is their mean); a unit with fewer gets the wrapped strategy's result."""
        return 3


class CoordinateRule(RobustRule):
    """A rule that is a statistic over the holders, coordinate by coordinate."""

    @abstractmethod
    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        """The unit's tensor from the holders' tensors of one adapter-state name.

        Args:
            stacked: ``(n, *shape)`` float64, one holder per row, ``n >= min_holders()``.

        Returns:
            ``(*shape)`` float64 (the caller casts it to the global tensor's dtype).
        """


class SelectionRule(RobustRule):
    """A rule that selects holders; the wrapped aggregation strategy aggregates the
    selected ones (so its weights, e.g. |D_c| or usage counts, still apply)."""

    @abstractmethod
    def select(self, flat: torch.Tensor) -> list[int]:
        """The holders to keep for one unit.

        Args:
            flat: ``(n, d)`` float64: each holder's unit tensors flattened and
                concatenated (in the unit's key order), ``n >= min_holders()``.

        Returns:
            Row indices into ``flat``, ascending, at least one.
        """


def get_robust_rule(name: str) -> type[RobustRule]:
    """The robust rule class registered as ``name``.

    Raises:
        protocol.plugins.UnknownNameError: unknown name (a KeyError and a ValueError;
            suggests near misses, lists the known ones).
    """
    return RobustRule.lookup(name)
