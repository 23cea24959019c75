"""Client-expert fitness scores Q (FLEX-MoE, Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 5-7; docs/methods/flex-moe.md).

One matrix per MoE layer, rows by device id, ``E`` columns:

- indicator ``s[c,e]`` = ``a[c,e]`` (acc-driven, eq. 5) or ``exp(-alpha_L * l[c,e])``
  (loss-driven, eq. 6), from the device's reported ``expert_acc`` / ``expert_loss``
  (samples whose *majority* expert is e, see :mod:`moe_model.stats`);
- EMA (eq. 7): ``Q_t = (1 - beta) Q_{t-1} + beta s`` for the pairs the device held this
  round, carried over otherwise; a new device's row starts at ``Q_0`` (0.2).

A held expert that no training sample was majority-routed to has no indicator this
round (the device reports ``None``); its score is carried over, like an unheld one.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from protocol.experts import layers_from_json, layers_to_json

from ..strategy import ClientResult


class Fitness:
    """Per-layer fitness matrices ``Q`` (rows: device ids, columns: experts).

    Args:
        layers: MoE layer indices.
        num_experts: E.
        indicator: ``"acc"`` (eq. 5) or ``"loss"`` (eq. 6).
        alpha_L: loss scale of eq. 6 (> 0).
        beta: EMA rate of eq. 7, in (0, 1].
        q0: initial score of every pair.

    Raises:
        ValueError: unknown indicator or out-of-range parameters.
    """

    def __init__(self, layers: Iterable[int], num_experts: int, indicator: str = "acc", alpha_L: float = 1.0,
                 beta: float = 0.1, q0: float = 0.2):
        if indicator not in ("acc", "loss"):
            raise ValueError(f"fitness indicator must be 'acc' or 'loss', got {indicator!r}")
        if not 0 < beta <= 1 or alpha_L <= 0:
            raise ValueError(f"need 0 < beta <= 1 and alpha_L > 0 (got beta={beta}, alpha_L={alpha_L})")
        self.layers = list(layers)
        self.num_experts = int(num_experts)
        self.indicator, self.alpha_L, self.beta, self.q0 = indicator, float(alpha_L), float(beta), float(q0)
        self.q: dict[int, dict[str, list[float]]] = {layer: {} for layer in self.layers}

    def indicator_value(self, acc: float | None, loss: float | None) -> float | None:
        """``s[c,e]`` from one expert's reported accuracy / loss; None when not reported."""
        if self.indicator == "acc":
            return None if acc is None else float(acc)
        return None if loss is None else math.exp(-self.alpha_L * float(loss))

    def row(self, layer: int, device_id: str) -> list[float]:
        """Q row of a device (``E`` floats); ``Q_0`` everywhere for an unseen device."""
        return list(self.q[layer].get(device_id, [self.q0] * self.num_experts))

    def matrix(self, layer: int, device_ids: list[str]) -> np.ndarray:
        """``(len(device_ids), E)`` float64 Q of ``layer`` in the order given."""
        return np.array([self.row(layer, d) for d in device_ids], dtype=np.float64).reshape(len(device_ids),
                                                                                           self.num_experts)

    def update(self, results: Iterable[ClientResult]) -> None:
        """Apply eq. 7 with each accepted result's statistics (held experts only)."""
        for r in results:
            if r.stats is None:
                continue
            for ls in r.stats.layers:
                if ls.layer not in self.q:
                    continue
                q = self.row(ls.layer, r.device_id)
                for e in r.experts.get(ls.layer, []):
                    s = self.indicator_value(ls.expert_acc[e], ls.expert_loss[e])
                    if s is not None:
                        q[e] = (1 - self.beta) * q[e] + self.beta * s
                self.q[ls.layer][r.device_id] = q

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable ``{"q": {str(layer): {device_id: [E floats]}}}``."""
        return {"q": layers_to_json(self.q)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s rows; layers this instance does not have are ignored."""
        for layer, rows in layers_from_json(state.get("q", {})).items():
            if layer in self.q:
                self.q[layer] = {d: list(map(float, v)) for d, v in rows.items()}


def top_k_rows(q: np.ndarray, k: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """Greedy assignment (eq. 20): each row's ``k[c]`` highest scores.

    Args:
        q: ``(C, E)`` scores.
        k: ``(C,)`` ints in ``0..E``.
        rng: breaks exact ties at random when given (otherwise the lower index wins).

    Returns:
        ``(C, E)`` bool, row c with exactly ``k[c]`` True.
    """
    C, E = q.shape
    tie = rng.random((C, E)) if rng is not None else np.broadcast_to(np.arange(E, dtype=np.float64), (C, E))
    # lexsort: last key is primary -> score descending, then the tie key ascending
    order = np.lexsort((tie, -q), axis=1)
    x = np.zeros((C, E), dtype=bool)
    for c in range(C):
        x[c, order[c, : int(k[c])]] = True
    return x
