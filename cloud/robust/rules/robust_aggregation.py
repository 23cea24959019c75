"""Byzantine-robust aggregation rules as a wrapper around any aggregation strategy.

:class:`RobustAggregation` wraps an :class:`~cloud.aggregation.base.AggregationStrategy`
(e.g. :class:`~cloud.aggregation.modular.Modular`,
:class:`~cloud.aggregation.usage_weighted.UsageWeighted`) and replaces its weighted mean
by a robust rule (:class:`~.base.RobustRule`, one module of this package each), one
**aggregation unit** at a time. A unit is :attr:`protocol.keys.Key.module` of a key:
``("expert", l, e)`` is the tensors of expert ``e`` of MoE layer ``l`` *together with*
its router row, ``("head", task)`` a task's head, ``("backbone",)`` the backbone. A
result *holds* a unit when its ``state`` has every key of that unit present in the
global state; only holders take part in a unit's aggregation (a result with part of a
unit's keys counts as no holder of it; the protocol never sends one). All holders
started the round from the same global state, so statistics over their states equal the
same statistics over their updates applied to that state.

**Few-holder fallback.** A unit with fewer holders than the rule's
:meth:`~.base.RobustRule.min_holders` (3; ``2f + 3`` for ``multi_krum``) is the wrapped
strategy's result for it (unchanged with none). A median of one or two values is their
mean, and Krum cannot tell an outlier among too few points, so a rule would only pretend
to defend there; experts that few devices hold are protected by update screening (bounds
on the update's norm, before aggregation), not by these rules. Keys no result holds stay
unchanged.

Costs: the wrapped strategy's :meth:`aggregate` runs once on all results (the fallback)
and, for a selection rule (``multi_krum``) when some unit is handled by selection, once
more on results whose states lack the units where they were not selected. It should
therefore have no side effects in :meth:`aggregate` (the built-in ones have none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from protocol import keys

from ...aggregation.base import AggregationStrategy
from ...strategy import ClientResult, Failure
from .base import CoordinateRule, RobustRule, get_robust_rule

Unit = tuple


def _stack(name: str, current: torch.Tensor, holders: list[ClientResult]) -> torch.Tensor:
    """The holders' tensors for ``name`` as float64, shape ``(n, *current.shape)``.

    Raises:
        ValueError: a holder's tensor has another shape than the global one.
    """
    rows = []
    for r in holders:
        t = r.state[name]
        if tuple(t.shape) != tuple(current.shape):
            raise ValueError(f"{r.device_id}: {name} has shape {tuple(t.shape)}, "
                             f"the global state {tuple(current.shape)}")
        rows.append(t.to(device=current.device, dtype=torch.float64))
    return torch.stack(rows)


class RobustAggregation(AggregationStrategy):
    """A robust rule applied per aggregation unit on top of another aggregation strategy.

    Not registered by name (the config composes it: ``inner`` + ``rule``); ``label`` is
    ``"{inner.name}+{rule}"``.

    Args:
        inner: the strategy whose result is used for units with too few holders and,
            for a selection rule (``multi_krum``), over the selected holders.
        rule: a registered :class:`~.base.RobustRule` name (``median``,
            ``trimmed_mean``, ``multi_krum``, or a third party's).
        **params: the rule's parameters (``trim`` for ``trimmed_mean``; ``f``, ``m`` for
            ``multi_krum``).

    Raises:
        ValueError: unknown rule (:class:`protocol.plugins.UnknownNameError`: suggests
            near misses, lists the known ones), unknown parameter, or an invalid value
            (``trim`` outside ``[0, 0.5)``, ``f < 0``, ``m < 1``).
        TypeError: ``inner`` is not an :class:`AggregationStrategy`.

    Attributes:
        report: after each :meth:`aggregate`, JSON-serialisable: ``rule``, ``params``,
            ``units`` (units some result holds), ``robust_units`` (handled by the rule),
            ``fallback_units`` (too few holders: the inner strategy's result),
            ``unheld_units`` (held by nobody: unchanged), ``min_holders`` (holders a unit
            needs for the rule), ``dropped`` (device -> number of units where a
            selection rule left it out; empty for coordinate rules).

    Sources: Yin et al., ICML 2018 (median, trimmed mean); Blanchard et al., NeurIPS
    2017 (Krum); El Mhamdi et al., ICML 2018 (Multi-Krum). See the module docstring.
    """

    name = ""

    def __init__(self, inner: AggregationStrategy, rule: str, **params: Any):
        super().__init__()
        if not isinstance(inner, AggregationStrategy):
            raise TypeError(f"inner must be an AggregationStrategy, got {type(inner).__name__}")
        self.impl: RobustRule = get_robust_rule(rule)(**params)
        self.inner = inner
        self.rule = self.impl.name
        self.params = self.impl.params
        self.label = f"{inner.name or type(inner).__name__}+{self.rule}"
        self.report: dict[str, Any] = {}

    def min_holders(self) -> int:
        """Holders a unit needs for the rule to apply (:meth:`RobustRule.min_holders`:
        3, or ``2f + 3`` for Multi-Krum)."""
        return self.impl.min_holders()

    def aggregate(
        self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult], failures: list[Failure]
    ) -> dict[str, torch.Tensor]:
        """The next global state: the rule on units with at least :meth:`min_holders`
        holders, the inner strategy's result on the others, unheld keys unchanged.

        Args:
            global_state: key -> tensor; every key must parse with
                :func:`protocol.keys.parse`.
            results: accepted updates; ``state`` tensors have the global shapes.

        Returns:
            A new dict with the keys, shapes and dtypes of ``global_state``; inputs are
            not modified.

        Raises:
            ValueError: a key that is no adapter-state key, or a holder's tensor whose
                shape differs from the global one.
        """
        units: dict[Unit, list[str]] = keys.units(global_state)
        holders = {u: [r for r in results if all(k in r.state for k in names)] for u, names in units.items()}
        need = self.min_holders()
        robust = [u for u in units if len(holders[u]) >= need]
        fallback = [u for u in units if 0 < len(holders[u]) < need]
        dropped: dict[str, int] = {}
        self.report = {
            "rule": self.rule, "params": dict(self.params), "units": len(robust) + len(fallback),
            "robust_units": len(robust), "fallback_units": len(fallback),
            "unheld_units": len(units) - len(robust) - len(fallback), "min_holders": need, "dropped": dropped,
        }
        if not results:
            return dict(global_state)

        out = dict(self.inner.aggregate(round, global_state, results, failures))
        if isinstance(self.impl, CoordinateRule):
            for u in robust:
                for name in units[u]:
                    current = global_state[name]
                    out[name] = self.impl.combine(_stack(name, current, holders[u])).to(current.dtype)
            return out

        # a selection rule: select per unit, then one inner pass over the selected holders.
        drop_keys: dict[int, set[str]] = {}  # id(result) -> keys of units where it was left out
        for u in robust:
            hs = holders[u]
            flat = torch.cat([_stack(name, global_state[name], hs).reshape(len(hs), -1) for name in units[u]], dim=1)
            keep = set(self.impl.select(flat))
            for i, r in enumerate(hs):
                if i not in keep:
                    drop_keys.setdefault(id(r), set()).update(units[u])
                    dropped[r.device_id] = dropped.get(r.device_id, 0) + 1
        if robust:
            filtered = [
                dataclasses.replace(r, state={k: v for k, v in r.state.items() if k not in drop_keys[id(r)]})
                if id(r) in drop_keys else r
                for r in results
            ]
            selected = self.inner.aggregate(round, global_state, filtered, failures)
            for u in robust:
                for name in units[u]:
                    out[name] = selected[name]
        return out

    def metrics(self) -> dict[str, Any]:
        """The inner strategy's figures of its last pass (:meth:`AggregationStrategy.metrics`)."""
        return self.inner.metrics()

    def state_dict(self) -> dict[str, Any]:
        """``{"inner": inner.state_dict()}`` (the rules themselves keep no state)."""
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a state without ``"inner"`` (saved by the
        unwrapped strategy) goes to the inner strategy as is."""
        self.inner.load_state_dict(state.get("inner", state))
