"""Load-balance metrics over expert workloads (FLEX-MoE, Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 8-9).

For one MoE layer, the workload of expert e over a window of rounds is
``W_e = sum over rounds, sum over clients holding e of u[c,e]`` (tokens routed to e).

- Coefficient of variation (eq. 8): ``CV = std_e(W_e) / mean_e(W_e)`` (population std;
  0 when the mean is 0).
- Max-Min gap (eq. 9): ``Gap = max_e W_e - min_e W_e``.

The same measures over the *assigned* data volume ``A_e = sum over clients holding e of
|D_c|`` (samples; what FLEX-MoE's constraints eq. 12-13 bound) tell an assignment's balance
apart from the routers': a plan can hold every expert equally often while the routers send
most tokens to a few of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from protocol.experts import layers_from_json, layers_to_json


def coefficient_of_variation(load: Sequence[float]) -> float:
    """CV of a load vector (eq. 8); 0.0 for an all-zero or empty vector."""
    w = np.asarray(load, dtype=np.float64)
    if w.size == 0 or w.mean() == 0:
        return 0.0
    return float(w.std() / w.mean())


def max_min_gap(load: Sequence[float]) -> float:
    """max - min of a load vector (eq. 9); 0.0 for an empty vector."""
    w = np.asarray(load, dtype=np.float64)
    return float(w.max() - w.min()) if w.size else 0.0


def round_load(per_device: Iterable[dict[int, Sequence[int]]], layers: Sequence[int],
               num_experts: int) -> dict[int, list[int]]:
    """Sum usage counts of one round over devices: layer -> E token counts."""
    total = {layer: np.zeros(num_experts, dtype=np.int64) for layer in layers}
    for usage in per_device:
        for layer, u in usage.items():
            if layer in total:
                total[layer] += np.asarray(u, dtype=np.int64)
    return {layer: v.tolist() for layer, v in total.items()}


def assigned_load(held: Iterable[tuple[int, dict[int, Sequence[int]]]], layers: Sequence[int],
                  num_experts: int) -> dict[int, list[int]]:
    """The data volume assigned to each expert in one round: layer -> E sample counts
    ``A_e = sum_{c holds e} |D_c|``.

    Args:
        held: ``(num_samples, layer -> held expert ids)`` per device (the accepted updates'
            capped sample counts).
    """
    total = {layer: np.zeros(num_experts, dtype=np.int64) for layer in layers}
    for n, experts in held:
        for layer, ids in experts.items():
            if layer in total:
                total[layer][np.asarray(list(ids), dtype=np.int64)] += int(n)
    return {layer: v.tolist() for layer, v in total.items()}


@dataclass
class LoadWindow:
    """Cumulative expert workload over the last ``window`` rounds (None = all rounds).

    ``add(load)`` after each round; ``cv()``/``gap()`` per layer and their means.
    """

    layers: Sequence[int]
    num_experts: int
    window: int | None = None
    _history: list[dict[int, list[int]]] = field(default_factory=list)

    def add(self, load: dict[int, Sequence[int]]) -> None:
        """Append one round's load (layer -> E token counts; a missing layer counts zeros), dropping the
        oldest round beyond ``window``."""
        self._history.append({layer: list(load.get(layer, [0] * self.num_experts)) for layer in self.layers})
        if self.window is not None and len(self._history) > self.window:
            self._history.pop(0)

    def totals(self) -> dict[int, list[int]]:
        """layer -> W_e over the window."""
        out = {}
        for layer in self.layers:
            acc = np.zeros(self.num_experts, dtype=np.int64)
            for h in self._history:
                acc += np.asarray(h[layer], dtype=np.int64)
            out[layer] = acc.tolist()
        return out

    def cv(self) -> dict[int, float]:
        """layer -> CV of ``W_e`` over the window (eq. 8)."""
        return {layer: coefficient_of_variation(w) for layer, w in self.totals().items()}

    def gap(self) -> dict[int, float]:
        """layer -> max-min gap of ``W_e`` over the window, in tokens (eq. 9)."""
        return {layer: max_min_gap(w) for layer, w in self.totals().items()}

    def summary(self, prefix: str = "") -> dict[str, object]:
        """``{prefix}cv``/``{prefix}max_min_gap`` averaged over layers, plus the per-layer values."""
        cv, gap = self.cv(), self.gap()
        return {
            f"{prefix}cv": float(np.mean(list(cv.values()))) if cv else 0.0,
            f"{prefix}max_min_gap": float(np.mean(list(gap.values()))) if gap else 0.0,
            f"{prefix}cv_per_layer": layers_to_json(cv),
            f"{prefix}max_min_gap_per_layer": layers_to_json(gap),
        }

    def state_dict(self) -> dict:
        """JSON-serialisable ``{"history": [{str(layer): [E counts]} per round]}``."""
        return {"history": [layers_to_json(h) for h in self._history]}

    def load_state_dict(self, d: dict) -> None:
        """Restore the history :meth:`state_dict` returned (replacing the current one)."""
        self._history = [layers_from_json(h) for h in d.get("history", [])]
