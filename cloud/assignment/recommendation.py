"""FedMoE expert recommendation (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, Algorithm 1 lines 10-30,
eq. 4-6; docs/methods/fedmoe.md step 5). Pure functions; :class:`.fedmoe.FedMoE`
decides when to call them (after ``patience`` rounds without a better validation score)
and makes the change exploratory (reverted and frozen if the next score does not improve).

Vectors are the activation probabilities p[l][e] of a device flattened over sorted
layers and experts (length L·E).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from protocol.experts import Experts

Probs = Mapping[int, Sequence[float]]


def flatten(p: Probs) -> list[float]:
    """p flattened over sorted layers (length L·E)."""
    return [float(x) for layer in sorted(p) for x in p[layer]]


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    """Eq. 4: cosine similarity of two activation vectors; 0 when either is all zeros.
    Raises ValueError on different lengths."""
    if len(u) != len(v):
        raise ValueError(f"activation vectors differ in length: {len(u)} vs {len(v)}")
    dot = sum(a * b for a, b in zip(u, v))
    nu, nv = math.sqrt(sum(a * a for a in u)), math.sqrt(sum(b * b for b in v))
    return dot / (nu * nv) if nu > 0 and nv > 0 else 0.0


def top_similar(own: Probs, others: Mapping[str, Probs], k: int) -> list[tuple[str, float]]:
    """Eq. 5: the ``k`` devices most similar to ``own`` as (device, similarity), most
    similar first (ties by device id)."""
    u = flatten(own)
    sims = [(d, cosine(u, flatten(p))) for d, p in others.items()]
    sims.sort(key=lambda x: (-x[1], x[0]))
    return sims[:k]


def estimate_hat(similar: Sequence[tuple[str, float]], others: Mapping[str, Probs]) -> dict[int, list[float]]:
    """Eq. 6: p̂[l][e] = Σ_a sim_a · p_a[l][e] / Σ_a sim_a over the similar devices
    (plain mean where the similarities sum to <= 0)."""
    total = sum(s for _, s in similar)
    weights = [(s / total) if total > 0 else 1.0 / len(similar) for _, s in similar]
    out: dict[int, list[float]] = {}
    for w, (d, _) in zip(weights, similar):
        for layer, row in others[d].items():
            acc = out.setdefault(int(layer), [0.0] * len(row))
            for e, x in enumerate(row):
                acc[e] += w * float(x)
    return out


def recommend(
    own_p: Probs,
    own: Mapping[int, Sequence[int]],
    others: Mapping[str, Probs],
    counts: Mapping[str, int],
    k: int = 3,
    fits: Callable[[Experts], bool] = lambda _: True,
    min_experts: int = 1,
) -> Experts | None:
    """A device's adjusted sub-model (Algorithm 1 lines 12-29).

    n = round(mean expert count of the top-``k`` similar devices − own count); n > 0 adds
    the n experts outside the sub-model with the highest p̂ (one at a time, while
    ``fits`` allows); n < 0 removes the |n| inside with the lowest p̂ (every layer
    keeps ``min_experts``).

    Args:
        own_p: the device's activation probabilities (layer -> per expert).
        own: its current sub-model (layer -> expert ids).
        others: other devices' activation probabilities.
        counts: other devices' total expert counts.
        fits: whether a candidate sub-model fits the device's memory budget.

    Returns:
        The new sub-model (layer -> sorted ids), or None without any other device.
    """
    pool = {d: p for d, p in others.items() if d in counts}
    if not pool:
        return None
    sim = top_similar(own_p, pool, k)
    own_count = sum(len(v) for v in own.values())
    n = round(sum(counts[d] for d, _ in sim) / len(sim) - own_count)
    hat = estimate_hat(sim, pool)
    new = Experts(own).as_dict()

    def score(layer: int, e: int) -> float:
        row = hat.get(layer, ())
        return float(row[e]) if e < len(row) else 0.0

    if n > 0:
        outside = [(score(layer, e), layer, e) for layer in sorted(new)
                   for e in range(len(own_p.get(layer, ()))) if e not in new[layer]]
        outside.sort(key=lambda x: (-x[0], x[1], x[2]))
        added = 0
        for _, layer, e in outside:
            if added >= n:
                break
            trial = {**new, layer: sorted(new[layer] + [e])}
            if not fits(trial):
                break
            new, added = trial, added + 1
    elif n < 0:
        inside = [(score(layer, e), layer, e) for layer in sorted(new) for e in new[layer]]
        inside.sort(key=lambda x: (x[0], x[1], x[2]))
        removed = 0
        for _, layer, e in inside:
            if removed >= -n:
                break
            if len(new[layer]) <= min_experts:
                continue
            new = {**new, layer: [x for x in new[layer] if x != e]}
            removed += 1
    return new
