"""Byzantine-robust aggregation rules as wrappers around any aggregation strategy.

:class:`RobustAggregation` wraps an :class:`~cloud.aggregation.base.AggregationStrategy`
(e.g. :class:`~cloud.aggregation.modular.Modular`,
:class:`~cloud.aggregation.usage_weighted.UsageWeighted`) and replaces its weighted mean
by a robust rule, one **aggregation unit** at a time. A unit is
:attr:`protocol.keys.Key.module` of a key: ``("expert", l, e)`` is the tensors of expert
``e`` of MoE layer ``l`` *together with* its router row, ``("head", task)`` a task's
head, ``("backbone",)`` the backbone. A result *holds* a unit when its ``state`` has
every key of that unit present in the global state; only holders take part in a unit's
aggregation (a result with part of a unit's keys counts as no holder of it; the protocol
never sends one). All holders started the round from the same global state, so
statistics over their states equal the same statistics over their updates applied to
that state.

Rules (``n`` = holders of the unit):

- ``median``: coordinate-wise median of the holders' tensors, unweighted; for even ``n``
  the mean of the two middle values (``torch.quantile(x, 0.5)``), computed in float64.
  Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018; Flower's ``FedMedian``.
- ``trimmed_mean`` (``trim``, default 0.1, ``0 <= trim < 0.5``): per coordinate, sort
  the ``n`` values, drop ``k = max(1, floor(trim * n))`` from each end and average the
  rest, unweighted (the median when ``2k >= n``). Yin et al., ICML 2018.
- ``multi_krum`` (``f``, default 1, the assumed number of Byzantine holders; ``m``,
  default ``n - f``, how many are kept): each holder's unit tensors, flattened and
  concatenated in float64, get the score "sum of squared distances to its ``n - f - 2``
  nearest other holders"; the ``m`` lowest scores are selected and the unit is the
  *wrapped strategy's* aggregate over the selected holders only, so its weights
  (|D_c|, usage counts) still apply. Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine
  Learning with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017 (Krum);
  El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed Learning in
  Byzantium", ICML 2018 (Multi-Krum). Krum's guarantee needs ``n >= 2f + 3``.

**Few-holder fallback.** ``median`` and ``trimmed_mean`` need ``n >= 3`` holders and
``multi_krum`` ``n >= 2f + 3``; a unit with fewer holders is the wrapped strategy's
result for it (unchanged with none). A median of one or two values is their mean, and
Krum cannot tell an outlier among too few points, so a rule would only pretend to defend
there; experts that few devices hold are protected by update screening (bounds on the
update's norm, before aggregation), not by these rules. Keys no result holds stay
unchanged.

Costs: the wrapped strategy's :meth:`aggregate` runs once on all results (the fallback)
and, for ``multi_krum`` when some unit is handled by selection, once more on results
whose states lack the units where they were not selected. It should therefore have no
side effects in :meth:`aggregate` (the built-in ones have none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from protocol import keys

from ..aggregation.base import AggregationStrategy
from ..strategy import ClientResult, Failure

RULES: tuple[str, ...] = ("median", "trimmed_mean", "multi_krum")
"""The robust rules :class:`RobustAggregation` knows."""

_DEFAULTS: dict[str, dict[str, Any]] = {
    "median": {},
    "trimmed_mean": {"trim": 0.1},
    "multi_krum": {"f": 1, "m": None},
}

Unit = tuple


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_params(rule: str, params: dict[str, Any]) -> dict[str, Any]:
    """The rule's parameters with defaults filled in. Raises ValueError."""
    if rule not in RULES:
        raise ValueError(f"unknown robust aggregation rule {rule!r}; known: {list(RULES)}")
    allowed = _DEFAULTS[rule]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"robust rule {rule!r} got unknown parameters {unknown}; "
                         f"it takes {sorted(allowed) or 'none'}")
    p = {**allowed, **params}
    if rule == "trimmed_mean":
        trim = p["trim"]
        if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0 <= trim < 0.5:
            raise ValueError(f"trimmed_mean: trim must be a number with 0 <= trim < 0.5, got {trim!r}")
        p["trim"] = float(trim)
    if rule == "multi_krum":
        if not _is_int(p["f"]) or p["f"] < 0:
            raise ValueError(f"multi_krum: f (assumed Byzantine holders) must be an integer >= 0, got {p['f']!r}")
        if p["m"] is not None and (not _is_int(p["m"]) or p["m"] < 1):
            raise ValueError(f"multi_krum: m (holders selected) must be an integer >= 1 or None, got {p['m']!r}")
    return p


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


def median(stacked: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median over dim 0 (``torch.quantile(x, 0.5, dim=0)`` semantics).

    Args:
        stacked: ``(n, *shape)``, ``n >= 1``, float.

    Returns:
        ``(*shape)``: the middle value for odd ``n``, the mean of the two middle values
        for even ``n``. NaN sorts above every number, so a minority of NaN coordinates
        does not reach the result.
    """
    n = stacked.shape[0]
    s = torch.sort(stacked, dim=0).values
    if n % 2:
        return s[n // 2].clone()
    return (s[n // 2 - 1] + s[n // 2]) / 2


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


def krum_scores(flat: torch.Tensor, f: int) -> torch.Tensor:
    """Krum scores of ``n`` points.

    Args:
        flat: ``(n, d)`` float64, one flattened update per row; ``n >= f + 3``.
        f: assumed number of Byzantine rows.

    Returns:
        ``(n,)`` float64: for each row the sum of squared Euclidean distances to its
        ``n - f - 2`` nearest other rows; ``inf`` where that is not finite (NaN or inf
        in a row).
    """
    n = flat.shape[0]
    d2 = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist").pow(2)
    d2.fill_diagonal_(float("inf"))
    nearest = torch.sort(d2, dim=1).values[:, : n - f - 2]
    scores = nearest.sum(dim=1)
    return torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("inf")))


def multi_krum_select(flat: torch.Tensor, f: int, m: int) -> list[int]:
    """Multi-Krum: the row indices of the ``m`` lowest :func:`krum_scores`, ascending by
    index (ties broken by lower index). ``m`` is clamped to ``n``."""
    scores = krum_scores(flat, f).tolist()
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return sorted(order[: min(m, len(scores))])


class RobustAggregation(AggregationStrategy):
    """A robust rule applied per aggregation unit on top of another aggregation strategy.

    Not registered by name (the config composes it: ``inner`` + ``rule``); ``label`` is
    ``"{inner.name}+{rule}"``.

    Args:
        inner: the strategy whose result is used for units with too few holders and,
            for ``multi_krum``, over the selected holders.
        rule: one of :data:`RULES`.
        **params: ``trim`` for ``trimmed_mean``; ``f``, ``m`` for ``multi_krum``.

    Raises:
        ValueError: unknown rule (lists :data:`RULES`), unknown parameter, ``trim``
            outside ``[0, 0.5)``, ``f < 0`` or ``m < 1``.
        TypeError: ``inner`` is not an :class:`AggregationStrategy`.

    Attributes:
        report: after each :meth:`aggregate`, JSON-serialisable: ``rule``, ``params``,
            ``units`` (units some result holds), ``robust_units`` (handled by the rule),
            ``fallback_units`` (too few holders: the inner strategy's result),
            ``unheld_units`` (held by nobody: unchanged), ``min_holders`` (holders a unit
            needs for the rule), ``dropped`` (device -> number of units where Multi-Krum
            left it out; empty for the other rules).

    Sources: Yin et al., ICML 2018 (median, trimmed mean); Blanchard et al., NeurIPS
    2017 (Krum); El Mhamdi et al., ICML 2018 (Multi-Krum). See the module docstring.
    """

    name = ""

    def __init__(self, inner: AggregationStrategy, rule: str, **params: Any):
        super().__init__()
        if not isinstance(inner, AggregationStrategy):
            raise TypeError(f"inner must be an AggregationStrategy, got {type(inner).__name__}")
        self.params = _check_params(rule, params)
        self.inner = inner
        self.rule = rule
        self.label = f"{inner.name or type(inner).__name__}+{rule}"
        self.report: dict[str, Any] = {}

    def min_holders(self) -> int:
        """Holders a unit needs for the rule to apply: 3, or ``2f + 3`` for Multi-Krum."""
        return 2 * self.params["f"] + 3 if self.rule == "multi_krum" else 3

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
        if self.rule in ("median", "trimmed_mean"):
            for u in robust:
                for name in units[u]:
                    current = global_state[name]
                    stacked = _stack(name, current, holders[u])
                    agg = median(stacked) if self.rule == "median" else trimmed_mean(stacked, self.params["trim"])
                    out[name] = agg.to(current.dtype)
            return out

        # multi_krum: select per unit, then one inner pass over the selected holders.
        f, m = self.params["f"], self.params["m"]
        drop_keys: dict[int, set[str]] = {}  # id(result) -> keys of units where it was left out
        for u in robust:
            hs = holders[u]
            flat = torch.cat([_stack(name, global_state[name], hs).reshape(len(hs), -1) for name in units[u]], dim=1)
            keep = set(multi_krum_select(flat, f, len(hs) - f if m is None else m))
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

    def state_dict(self) -> dict[str, Any]:
        """``{"inner": inner.state_dict()}`` (the rules themselves keep no state)."""
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a state without ``"inner"`` (saved by the
        unwrapped strategy) goes to the inner strategy as is."""
        self.inner.load_state_dict(state.get("inner", state))
