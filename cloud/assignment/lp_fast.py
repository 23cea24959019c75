"""Fast path for the FLEX-MoE assignment program: LP relaxation + rounding + repair.

The integer program of Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 10-13 (one MoE layer)::

    max  sum_{c,e} Q[c,e] X[c,e]
    s.t. sum_e X[c,e] = k_c                        (eq. 11, every client c)
         L_e <= sum_c |D_c| X[c,e] <= U_e           (eq. 12-13, every expert e)
         X[c,e] in {0, 1}

Without the load rows the polytope is integral (each client row is a k-subset
polytope), so the LP relaxation is nearly integral: only clients whose row the few
binding load constraints split end up fractional. This module

1. solves the relaxation with HiGHS (``scipy.optimize.linprog(method="highs")``,
   sparse constraint matrix), which also gives an upper bound on the IP optimum;
2. rounds every client row to its ``k_c`` largest LP values (ties by Q), which keeps
   eq. 11 exact;
3. repairs the load bounds the rounding broke by single-expert moves (client c gives
   up expert e for e'), cheapest loss of Q first, never creating a new violation.

If the relaxation is infeasible the caller widens the bounds (as for the exact path);
if the repair cannot reach the bounds the result says so (``status="repair_failed"``)
and the caller treats it like an infeasible program.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class FastResult:
    """Outcome of :func:`solve_fast`.

    Attributes:
        x: ``(C, E)`` bool assignment, or None when the LP was infeasible.
        status: ``"optimal"`` (rounded LP already integral and feasible), ``"repaired"``,
            ``"infeasible"`` or ``"repair_failed"``.
        objective: ``sum Q*x`` of ``x`` (nan without ``x``).
        lp_bound: LP optimum, an upper bound on the IP optimum (nan when infeasible).
        fractional_rows: clients whose LP row was not integral.
        moves: repair moves applied.
    """

    x: np.ndarray | None
    status: str
    objective: float
    lp_bound: float
    fractional_rows: int = 0
    moves: int = 0


def _restricted_lp(q, sizes, k, lower, upper, cand: np.ndarray):
    """LP over the candidate columns ``cand`` (``(C, E)`` bool) only; returns
    (full ``(C, E)`` values or None, optimum, expert duals mu (``(E,)``, upper minus lower))."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix, vstack

    C, E = q.shape
    r, e = np.nonzero(cand)
    n = r.size
    idx = np.arange(n)
    a_eq = csr_matrix((np.ones(n), (r, idx)), shape=(C, n))
    load = csr_matrix((sizes[r].astype(np.float64), (e, idx)), shape=(E, n))
    res = linprog(-q[r, e], A_ub=vstack([load, -load]).tocsr(), b_ub=np.concatenate([upper, -lower]).astype(float),
                  A_eq=a_eq, b_eq=k.astype(np.float64), bounds=(0, 1), method="highs")
    if res.status != 0:
        return None, float("nan"), None
    x = np.zeros((C, E))
    x[r, e] = res.x
    marg = res.ineqlin.marginals
    return x, float(-res.fun), -marg[:E] + marg[E:]


def lagrangian_bound(q, sizes, k, lower, upper, mu: np.ndarray) -> float:
    """Upper bound on the program's optimum for any expert multipliers ``mu`` (LP duality):
    ``sum_c top-k_c(Q[c,:] - |D_c| mu) + sum_e (mu_e U_e if mu_e > 0 else mu_e L_e)``."""
    adj = q - sizes[:, None].astype(np.float64) * mu[None, :]
    srt = -np.sort(-adj, axis=1)
    mask = np.arange(q.shape[1])[None, :] < k[:, None]
    return float((srt * mask).sum() + np.where(mu > 0, mu * upper, mu * lower).sum())


def _top_mask(score: np.ndarray, k: np.ndarray) -> np.ndarray:
    C, E = score.shape
    order = np.argsort(-score, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(E), (C, E)), axis=1)
    return rank < k[:, None]


def solve_lp(q: np.ndarray, sizes: np.ndarray, k: np.ndarray, lower: np.ndarray, upper: np.ndarray,
             extra: int = 2, max_iter: int = 20):
    """The LP relaxation through HiGHS by column generation.

    Starts from each client's ``k_c + extra`` best experts by Q; after each solve, the
    expert duals price every left-out column (a column enters when it would be in its
    row's top-k of ``Q[c,e] - |D_c| mu_e``); stops when none enters, which certifies
    LP optimality (:func:`lagrangian_bound` then equals the LP value). A restricted
    program that is infeasible doubles ``extra`` (up to all columns).

    Returns:
        (``(C, E)`` LP values or None when infeasible, the LP optimum or nan).
    """
    C, E = q.shape
    cand = _top_mask(q, np.minimum(k + extra, E))
    for _ in range(max_iter):
        x, value, mu = _restricted_lp(q, sizes, k, lower, upper, cand)
        if x is None:
            if cand.all():
                return None, float("nan")
            extra = max(2 * extra, 1)
            cand |= _top_mask(q, np.minimum(k + extra, E))
            continue
        enter = _top_mask(q - sizes[:, None].astype(np.float64) * mu[None, :], k) & ~cand
        if not enter.any():
            return x, value
        cand |= enter
    log.warning("column generation did not converge in %d rounds; LP value is a lower estimate", max_iter)
    return x, value


def round_rows(xlp: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Each row's ``k[c]`` largest LP values (ties: higher Q, then lower index)."""
    C, E = xlp.shape
    order = np.lexsort((np.broadcast_to(np.arange(E), (C, E)), -q, -np.round(xlp, 9)), axis=1)
    x = np.zeros((C, E), dtype=bool)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(E), (C, E)), axis=1)
    x[:] = rank < k[:, None]
    return x


def repair(x: np.ndarray, q: np.ndarray, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray,
           max_moves: int | None = None) -> tuple[bool, int]:
    """Move experts between clients' sets until ``lower <= load <= upper`` (in place).

    A move swaps one held expert e of client c for an unheld e'; it keeps eq. 11
    exact, must reduce the total violation and create no new one, and among those the
    one losing the least Q is taken.

    Returns:
        (feasible now, moves made).
    """
    s = sizes.astype(np.float64)
    load = s @ x
    tol = 1e-7 * max(1.0, float(s.max(initial=1.0)))
    moves = 0
    limit = max_moves if max_moves is not None else 4 * x.shape[0] + 100
    while moves < limit:
        over = load - upper
        under = lower - load
        worst_over, worst_under = over.max(initial=-1), under.max(initial=-1)
        if worst_over <= tol and worst_under <= tol:
            return True, moves
        if worst_over >= worst_under:
            e = int(over.argmax())
            cand = np.flatnonzero(x[:, e])
            # target e' must stay under its upper bound; e must not drop below its lower bound.
            sc = s[cand]
            ok_src = load[e] - sc >= lower[e] - tol
            room = (load[None, :] + sc[:, None]) <= upper[None, :] + tol
            valid = room & ~x[cand] & ok_src[:, None]
            loss = q[cand, e][:, None] - q[cand]
        else:
            e2 = int(under.argmax())
            cand = np.flatnonzero(~x[:, e2])
            sc = s[cand]
            ok_dst = load[e2] + sc <= upper[e2] + tol
            keep = (load[None, :] - sc[:, None]) >= lower[None, :] - tol
            valid = keep & x[cand] & ok_dst[:, None]
            loss = q[cand] - q[cand, e2][:, None]
        if not valid.any():
            return False, moves
        loss = np.where(valid, loss, np.inf)
        i, j = np.unravel_index(int(loss.argmin()), loss.shape)
        c = int(cand[i])
        src, dst = (e, int(j)) if worst_over >= worst_under else (int(j), e2)
        x[c, src], x[c, dst] = False, True
        load[src] -= s[c]
        load[dst] += s[c]
        moves += 1
    return False, moves


def solve_fast(q: np.ndarray, sizes: np.ndarray, k: np.ndarray, lower: np.ndarray,
               upper: np.ndarray) -> FastResult:
    """LP relaxation + rounding + repair of the assignment program of one layer.

    Args:
        q: ``(C, E)`` fitness scores.
        sizes: ``(C,)`` |D_c| (samples).
        k: ``(C,)`` experts per client (eq. 11), each in ``0..E``.
        lower, upper: ``(E,)`` load bounds of eq. 12-13 in samples.

    Returns:
        A :class:`FastResult`; its ``x`` satisfies eq. 11 exactly and, unless the status
        is ``repair_failed``, the bounds.
    """
    xlp, bound = solve_lp(q, sizes, k, lower, upper)
    if xlp is None:
        return FastResult(None, "infeasible", float("nan"), float("nan"))
    frac = int((np.abs(xlp - np.round(xlp)) > 1e-6).any(axis=1).sum())
    x = round_rows(xlp, q, k)
    ok, moves = repair(x, q, sizes, lower, upper)
    status = ("optimal" if moves == 0 and frac == 0 else "repaired") if ok else "repair_failed"
    return FastResult(x, status, float((q * x).sum()), bound, frac, moves)
