"""``multi_krum`` (``f``, default 1, the assumed number of Byzantine holders; ``m``,
default ``n - f``, how many are kept): each holder's unit tensors, flattened and
concatenated in float64, get the score "sum of squared distances to its ``n - f - 2``
nearest other holders"; the ``m`` lowest scores are selected and the unit is the
*wrapped strategy's* aggregate over the selected holders only, so its weights (|D_c|,
usage counts) still apply. Krum's guarantee needs ``n >= 2f + 3`` holders.

Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries: Byzantine
Tolerant Gradient Descent", NeurIPS 2017 (Krum); El Mhamdi, Guerraoui, Rouault, "The
Hidden Vulnerability of Distributed Learning in Byzantium", ICML 2018 (Multi-Krum).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import SelectionRule


def squared_distances(flat: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances between the rows of ``flat``, by one Gram-matrix product.

    ``|x_i - x_j|^2 = |x_i|^2 + |x_j|^2 - 2 x_i.x_j`` with ``X X^T`` computed by BLAS (one
    ``addmm``), after subtracting the mean of the finite rows (distances do not change, and
    the norms become those of the rows' spread, so the subtraction cancels little). Pairwise
    differences row by row (``torch.cdist(..., compute_mode="donot_use_mm_for_euclid_dist")``)
    made Multi-Krum cost 280 s for 1,000 updates of the fleet's model; with this it costs 23 s
    (``results/fleet/aggregation_cost{,_baseline}.md``), within about 1e-12 of them relative
    to the largest distance in float64.

    Args:
        flat: ``(n, d)`` float, one flattened update per row.

    Returns:
        ``(n, n)`` in ``flat``'s dtype, >= 0, zero diagonal; NaN in the rows and columns of rows
        that are not finite.
    """
    finite = torch.isfinite(flat).all(dim=1)
    rows = flat if bool(finite.all()) else flat[finite]  # no copy in the usual case
    centred = flat - rows.mean(dim=0) if rows.shape[0] else flat
    sq = (centred * centred).sum(dim=1)
    d2 = torch.addmm(sq[:, None] + sq[None, :], centred, centred.T, alpha=-2.0).clamp_min_(0.0)
    d2.fill_diagonal_(0.0)
    bad = ~finite
    d2[bad, :] = float("nan")
    d2[:, bad] = float("nan")
    return d2


def krum_scores(flat: torch.Tensor, f: int) -> torch.Tensor:
    """Krum scores of ``n`` points (Blanchard et al., NeurIPS 2017, the score of Krum's
    definition: ``s(i) = sum over the n - f - 2 closest j != i of |V_i - V_j|^2``).

    Args:
        flat: ``(n, d)`` float64, one flattened update per row; ``n >= f + 3``.
        f: assumed number of Byzantine rows.

    Returns:
        ``(n,)`` float64: for each row the sum of squared Euclidean distances
        (:func:`squared_distances`) to its ``n - f - 2`` nearest other rows; ``inf`` where that
        is not finite (NaN or inf in a row, or a row among its nearest).
    """
    n = flat.shape[0]
    d2 = squared_distances(flat)
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class MultiKrum(SelectionRule):
    """:func:`multi_krum_select` per unit (Blanchard et al., NeurIPS 2017; El Mhamdi et
    al., ICML 2018).

    Args:
        f: assumed Byzantine holders, integer >= 0 (default 1).
        m: holders selected, integer >= 1, or None (default): ``n - f``.

    Raises:
        ValueError: ``f < 0``, ``m < 1``, a non-integer, or another parameter.
    """

    name = "multi_krum"
    defaults = {"f": 1, "m": None}

    def __init__(self, **params: Any):
        super().__init__(**params)
        f, m = self.params["f"], self.params["m"]
        if not _is_int(f) or f < 0:
            raise ValueError(f"multi_krum: f (assumed Byzantine holders) must be an integer >= 0, got {f!r}")
        if m is not None and (not _is_int(m) or m < 1):
            raise ValueError(f"multi_krum: m (holders selected) must be an integer >= 1 or None, got {m!r}")

    def min_holders(self) -> int:
        """``2f + 3``: Krum cannot tell an outlier among fewer points."""
        return 2 * self.params["f"] + 3

    def select(self, flat: torch.Tensor) -> list[int]:
        f, m = self.params["f"], self.params["m"]
        return multi_krum_select(flat, f, flat.shape[0] - f if m is None else m)
