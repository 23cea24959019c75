"""Splitting a labelled data set across simulated clients (fixed seed).

- ``iid``: a random equal split.
- ``dirichlet:α``: the standard label-skew partition (Hsu et al., 2019): for every
  class, client proportions ~ Dirichlet(α·1); redrawn until every client has at least
  ``min_size`` samples.
- ``classes:k``: every client holds k classes (classes dealt round-robin from a
  shuffled order), each class split evenly among the clients holding it.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np


def parse_partition(text: str) -> tuple[str, float]:
    """``"dirichlet:0.5"`` -> ("dirichlet", 0.5); ``"iid"`` -> ("iid", 0).

    Raises:
        ValueError: unknown scheme or a bad parameter.
    """
    name, _, arg = text.partition(":")
    if name == "iid" and not arg:
        return "iid", 0.0
    if name in ("dirichlet", "classes") and arg:
        try:
            value = float(arg)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf or (name == "classes" and not value.is_integer()):
            want = "dirichlet:ALPHA with ALPHA > 0" if name == "dirichlet" else "classes:K with a whole K >= 1"
            raise ValueError(f"bad partition parameter in {text!r}: want {want}")
        return name, value
    raise ValueError(f"unknown partition {text!r}; use iid, dirichlet:ALPHA or classes:K")


def split_train_test(n: int, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Random (train indices, test indices) of ``n`` items."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = int(round(n * test_fraction))
    return sorted(order[cut:]), sorted(order[:cut])


def drop_test_texts(items: Sequence[tuple], train_idx: Sequence[int], test_idx: Sequence[int]) -> list[int]:
    """``train_idx`` without every index whose input (``items[i][0]``, a text) equals a test
    item's, order kept: a text in both parts (BBC News repeats 33 texts, the tweets 602)
    would be trained on and then tested on. The test part is left as it is. Deterministic;
    ``fedmoe simulate``'s split and ``fedmoe data split`` both use it."""
    test_texts = {items[i][0] for i in test_idx}
    return [i for i in train_idx if items[i][0] not in test_texts]


def reserve(indices: Sequence[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``indices`` (a task's training split) into (what the devices share, what the
    cloud keeps): a seeded random ``fraction`` (at least one item) is reserved, e.g.
    Fed-MoE's server-reserved set D^r (Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610 Sec. 3: "non-overlapping
    with client data"). Disjoint by construction, deterministic for a seed; both sorted.

    Raises:
        ValueError: ``fraction`` outside (0, 1), or fewer than two indices.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"reserve fraction must be in (0, 1), got {fraction!r}")
    if len(indices) < 2:
        raise ValueError(f"cannot reserve part of {len(indices)} items")
    order = list(indices)
    random.Random(f"reserve/{seed}").shuffle(order)
    cut = min(len(order) - 1, max(1, int(round(len(order) * fraction))))
    return sorted(order[cut:]), sorted(order[:cut])


def partition(labels: Sequence[int], num_clients: int, scheme: str, seed: int, min_size: int = 10) -> list[list[int]]:
    """Indices of ``labels`` per client under ``scheme`` (see :func:`parse_partition`).

    Raises:
        ValueError: unknown scheme, ``classes:k`` with k above the class count, or no
            Dirichlet draw in 1000 giving every client ``min_size`` samples (or its fair share
            ``len(labels) // num_clients`` where that is smaller).
    """
    name, arg = parse_partition(scheme)
    y = np.asarray(labels)
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    if name == "iid":
        order = rng.permutation(len(y))
        return [sorted(part.tolist()) for part in np.array_split(order, num_clients)]
    if name == "dirichlet":
        for _ in range(1000):
            parts: list[list[int]] = [[] for _ in range(num_clients)]
            for c in classes:
                idx = rng.permutation(np.flatnonzero(y == c))
                props = rng.dirichlet(np.full(num_clients, arg))
                cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
                for k, part in enumerate(np.split(idx, cuts)):
                    parts[k].extend(part.tolist())
            if min(len(p) for p in parts) >= min(min_size, len(y) // num_clients):
                return [sorted(p) for p in parts]
        raise ValueError(
            f"could not draw a Dirichlet({arg}) partition of {len(y)} samples over {num_clients} clients "
            f"with at least {min(min_size, len(y) // num_clients)} samples each (1000 draws): "
            "use fewer clients, a larger alpha, or iid")
    k = int(arg)
    if k > len(classes):
        raise ValueError(f"classes:{k} but the data has only {len(classes)} classes")
    order = rng.permutation(classes)
    held = [[order[(i * k + j) % len(classes)] for j in range(k)] for i in range(num_clients)]
    parts = [[] for _ in range(num_clients)]
    for c in classes:
        owners = [i for i in range(num_clients) if c in held[i]]
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        for i, part in zip(owners, np.array_split(idx, len(owners))):
            parts[i].extend(part.tolist())
    return [sorted(p) for p in parts]
