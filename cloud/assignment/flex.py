"""``flex``: FLEX-MoE load-balanced expert assignment (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070; docs/methods/flex-moe.md).

Per round and per MoE layer (one program per layer; Q is kept per layer):

1. Fitness Q (eq. 5-7, :mod:`.fitness`), updated in :meth:`Flex.observe` from the
   devices' per-expert accuracy or loss.
2. Dynamic bounds (eq. 14-19, :class:`LoadBounds`): ``tau = sum_c |D_c| k_c / E``;
   ``d_e = W_e^(t-1) - tau^(t-1)`` with ``W_e`` the samples assigned to e last round;
   ``D_e <- (1-gamma) D_e + gamma d_e``; ``target_e = tau - alpha_adj D_e``;
   ``delta = delta_ratio tau``; ``L = max(0, target - delta)``, ``U = target + delta``.
3. The integer program (eq. 10-13, :func:`solve_exact` through PuLP: CBC by default,
   HiGHS with ``solver: highs``; or the LP-relaxation fast path ``solver: fast``,
   :mod:`.lp_fast`): maximise ``sum Q X`` with ``sum_e X[c,e] = k_c`` and
   ``L_e <= sum_c |D_c| X[c,e] <= U_e``.
4. Infeasible bounds never fail a round: ``delta`` is doubled up to ``max_widen`` times
   (logged, recorded as ``widened``); after that the greedy top-k of eq. 20 is used
   (``greedy_fallback``). ``Plan.info["status"]`` carries the worst layer's status and
   ``Plan.info["layers"]`` the details.
5. A PuLP solver (cbc, highs) that *raises* is a different matter, decided by
   ``on_solver_error``: ``"greedy"`` (default) uses the greedy top-k for that layer,
   logs one ERROR per round with the exception and records ``status: greedy_fallback``
   and ``solver_error`` in ``Plan.info`` (and in that layer's entry); ``"fail"`` lets the
   exception propagate out of :meth:`Flex.configure` (the strategy's state is left as it
   was before the call). Only ``Exception`` is caught, never ``KeyboardInterrupt`` or
   ``SystemExit``. The in-process fast path is not covered: its exceptions always
   propagate.

``k_c`` is the device's capacity (experts per layer its memory budget holds, clipped to E).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.experts import layers_from_json, layers_to_json

from ..strategy import ClientResult, DeviceView, Failure, Plan
from .base import AssignmentStrategy
from .fitness import Fitness, top_k_rows
from .lp_fast import solve_fast

log = logging.getLogger(__name__)
_RANK = {"optimal": 0, "widened": 1, "greedy_fallback": 2}
ON_SOLVER_ERROR = ("greedy", "fail")
"""Values of ``on_solver_error``: fall back to the greedy top-k, or let the exception propagate."""


@dataclass
class Bounds:
    """Per-expert load bounds of one round (samples): ``lower``, ``upper`` ``(E,)``."""

    tau: float
    target: np.ndarray
    delta: float
    lower: np.ndarray
    upper: np.ndarray

    def widened(self, factor: float) -> "Bounds":
        """Same target, ``delta * factor`` (eq. 18-19 with a wider deviation)."""
        d = self.delta * factor
        return Bounds(self.tau, self.target, d, np.maximum(0.0, self.target - d), self.target + d)


@dataclass
class LoadBounds:
    """State of the dynamic bounds of one layer (eq. 14-19).

    Attributes:
        deficit: ``D_e`` (samples), smoothed over rounds.
        last_load, last_tau: ``W_e^(t-1)`` and ``tau^(t-1)`` of the last assignment.
    """

    num_experts: int
    gamma: float = 0.3
    alpha_adj: float = 0.5
    delta_ratio: float = 0.1
    deficit: np.ndarray = field(default=None)  # type: ignore[assignment]
    last_load: np.ndarray | None = None
    last_tau: float | None = None

    def __post_init__(self) -> None:
        if self.deficit is None:
            self.deficit = np.zeros(self.num_experts)

    def bounds(self, sizes: np.ndarray, k: np.ndarray) -> Bounds:
        """Bounds for this round; folds the last round's deviation into ``D`` first (eq. 15).

        Args:
            sizes: ``(C,)`` |D_c|; k: ``(C,)`` experts per client.
        """
        if self.last_load is not None and self.last_tau is not None:
            d = self.last_load - self.last_tau  # eq. 14
            self.deficit = (1 - self.gamma) * self.deficit + self.gamma * d  # eq. 15
            self.last_load = self.last_tau = None
        tau = float((sizes * k).sum()) / self.num_experts
        target = tau - self.alpha_adj * self.deficit  # eq. 16
        delta = self.delta_ratio * tau  # eq. 17
        return Bounds(tau, target, delta, np.maximum(0.0, target - delta), target + delta)  # eq. 18-19

    def record(self, x: np.ndarray, sizes: np.ndarray, tau: float) -> None:
        """Remember this round's assigned load ``W_e = sum_{c: X[c,e]} |D_c|`` and ``tau``."""
        self.last_load = sizes.astype(np.float64) @ x.astype(np.float64)
        self.last_tau = tau

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable ``deficit`` ``(E,)``, ``last_load`` ``(E,)`` or None (samples), ``last_tau``."""
        return {"deficit": self.deficit.tolist(),
                "last_load": None if self.last_load is None else self.last_load.tolist(), "last_tau": self.last_tau}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s arrays (float64); a missing ``deficit`` keeps the current one."""
        self.deficit = np.asarray(d.get("deficit", self.deficit), dtype=np.float64)
        self.last_load = None if d.get("last_load") is None else np.asarray(d["last_load"], dtype=np.float64)
        self.last_tau = d.get("last_tau")


def solve_exact(q: np.ndarray, sizes: np.ndarray, k: np.ndarray, lower: np.ndarray, upper: np.ndarray,
                solver: str = "cbc", time_limit: float | None = None) -> tuple[np.ndarray | None, str, float]:
    """The integer program of eq. 10-13 through PuLP.

    Args:
        q: ``(C, E)`` fitness; sizes: ``(C,)`` |D_c|; k: ``(C,)``; lower, upper: ``(E,)``.
        solver: ``"cbc"`` (bundled with PuLP) or ``"highs"`` (needs ``highspy``).
        time_limit: seconds for the solver (None: none).

    Returns:
        (``(C, E)`` bool or None, PuLP status text, objective or nan).

    Raises:
        ValueError: unknown solver name.
        pulp.PulpSolverError: the solver is not installed or crashed.
    """
    import warnings

    import pulp

    with warnings.catch_warnings():  # PuLP 3.x deprecation notices about its 4.0 API
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_pulp(pulp, q, sizes, k, lower, upper, solver, time_limit)


def _solve_pulp(pulp, q, sizes, k, lower, upper, solver, time_limit):
    C, E = q.shape
    prob = pulp.LpProblem("flex_assignment", pulp.LpMaximize)
    x = [[pulp.LpVariable(f"x_{c}_{e}", cat="Binary") for e in range(E)] for c in range(C)]
    prob += pulp.lpSum(float(q[c, e]) * x[c][e] for c in range(C) for e in range(E))
    for c in range(C):
        prob += pulp.lpSum(x[c]) == int(k[c]), f"cap_{c}"
    for e in range(E):
        load = pulp.lpSum(float(sizes[c]) * x[c][e] for c in range(C))
        prob += load <= float(upper[e]), f"up_{e}"
        prob += load >= float(lower[e]), f"low_{e}"
    if solver == "cbc":
        s = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    elif solver == "highs":
        s = pulp.HiGHS(msg=False, timeLimit=time_limit)
    else:
        raise ValueError(f"unknown solver {solver!r}; use cbc, highs or fast")
    prob.solve(s)
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        return None, status, float("nan")
    out = np.array([[(x[c][e].value() or 0) > 0.5 for e in range(E)] for c in range(C)], dtype=bool)
    if (out.sum(1) != k).any():  # time-limited incumbent that breaks eq. 11: treat as not solved
        return None, "NotSolved", float("nan")
    return out, status, float((q * out).sum())


def check_solver(solver: str) -> None:
    """Fail at configuration time, not mid-round, when ``solver`` cannot run here.

    Raises:
        ValueError: unknown solver name, or a known one whose package is not installed
            (``highs`` and ``fast`` need ``highspy`` / ``scipy``; ``cbc`` ships with PuLP).
    """
    if solver not in ("cbc", "highs", "fast"):
        raise ValueError(f"unknown solver {solver!r}; use cbc, highs or fast")
    if solver == "fast":
        import importlib.util

        if importlib.util.find_spec("scipy") is None:
            raise ValueError("solver 'fast' needs scipy (pip install scipy); use solver cbc")
        return
    import warnings

    import pulp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        available = (pulp.PULP_CBC_CMD if solver == "cbc" else pulp.HiGHS)(msg=False).available()
    if not available:
        raise ValueError(f"solver {solver!r} is not available here"
                         + (" (pip install highspy)" if solver == "highs" else "") + "; use another solver")


def solve_layer(q: np.ndarray, sizes: np.ndarray, k: np.ndarray, bounds: Bounds, solver: str = "cbc",
                widen_factor: float = 2.0, max_widen: int = 6, time_limit: float | None = None,
                rng: np.random.Generator | None = None,
                on_solver_error: str = "greedy") -> tuple[np.ndarray, dict[str, Any]]:
    """Solve one layer's program; widen the bounds when infeasible; greedy as last resort.

    Infeasibility is logged here at DEBUG (each widening, and the final greedy fallback);
    :meth:`Flex.configure` logs one WARNING line per round for all its layers.
    A PuLP solver that raises is not logged here (the caller logs it once per round,
    :meth:`Flex.configure`): with ``on_solver_error="greedy"`` the greedy top-k is
    returned and the exception recorded in ``info["solver_error"]``; with ``"fail"`` it
    propagates. Exceptions of the fast path always propagate.

    Returns:
        (``(C, E)`` bool assignment, info: ``status`` (optimal / widened /
        greedy_fallback), ``solver``, ``delta`` used, ``widenings``, ``objective``,
        ``lower``/``upper`` used, the fast path's ``lp_bound``, and after a solver
        exception ``solver_error`` (``"<type>: <message>"``)).

    Raises:
        ValueError: ``on_solver_error`` is neither ``"greedy"`` nor ``"fail"``.
        Exception: whatever the solver raised, when ``on_solver_error="fail"``.
    """
    if on_solver_error not in ON_SOLVER_ERROR:
        raise ValueError(f"on_solver_error must be one of {ON_SOLVER_ERROR}, not {on_solver_error!r}")
    b = bounds
    info: dict[str, Any] = {"solver": solver, "tau": bounds.tau}
    for attempt in range(max_widen + 1):
        if solver == "fast":
            r = solve_fast(q, sizes, k, b.lower, b.upper)
            x, status = (r.x if r.status in ("optimal", "repaired") else None), r.status
            info["lp_bound"] = r.lp_bound
        else:
            try:
                x, status, _ = solve_exact(q, sizes, k, b.lower, b.upper, solver, time_limit)
            except Exception as e:  # Exception only: KeyboardInterrupt / SystemExit always propagate
                if on_solver_error == "fail":
                    raise
                log.debug("assignment solver %s raised; greedy fallback for this layer", solver, exc_info=True)
                x = top_k_rows(q, k, rng)
                info.update(status="greedy_fallback", widenings=attempt, delta=b.delta,
                            solver_error=f"{type(e).__name__}: {e}", objective=float((q * x).sum()))
                return x, info
        if x is not None:
            info.update(status="optimal" if attempt == 0 else "widened", widenings=attempt, delta=b.delta,
                        solver_status=status, objective=float((q * x).sum()),
                        lower=b.lower.tolist(), upper=b.upper.tolist())
            return x, info
        log.debug("assignment program infeasible (%s) with delta %.1f; widening x%.1f", status, b.delta,
                  widen_factor)
        b = b.widened(widen_factor)
    log.debug("assignment program still infeasible after %d widenings; greedy fallback", max_widen)
    x = top_k_rows(q, k, rng)
    info.update(status="greedy_fallback", widenings=max_widen, delta=b.delta, objective=float((q * x).sum()))
    return x, info


class Flex(AssignmentStrategy):
    """FLEX-MoE assignment (see module docstring).

    Params (aggregator config ``assignment.params``): ``indicator`` acc|loss,
    ``alpha_L`` 1.0, ``beta`` 0.1, ``q0`` 0.2, ``gamma`` 0.3, ``alpha_adj`` 0.5,
    ``delta_ratio`` 0.1, ``solver`` cbc|highs|fast, ``widen_factor`` 2, ``max_widen`` 6,
    ``time_limit`` (s, per solve), ``on_solver_error`` greedy|fail (what a raising cbc/highs
    solver does to the round; module docstring, item 5).

    Raises:
        ValueError: at construction, for an unknown or unavailable ``solver``, a bad
            ``widen_factor``/``max_widen`` or an unknown ``on_solver_error``.
    """

    name = "flex"

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, indicator: str = "acc",
                 alpha_L: float = 1.0, beta: float = 0.1, q0: float = 0.2, gamma: float = 0.3,
                 alpha_adj: float = 0.5, delta_ratio: float = 0.1, solver: str = "cbc", widen_factor: float = 2.0,
                 max_widen: int = 6, time_limit: float | None = None, on_solver_error: str = "greedy",
                 **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        check_solver(solver)
        if widen_factor <= 1 or max_widen < 0:
            raise ValueError("widen_factor must exceed 1 and max_widen be >= 0")
        if on_solver_error not in ON_SOLVER_ERROR:
            raise ValueError(f"on_solver_error must be one of {ON_SOLVER_ERROR}, not {on_solver_error!r}")
        self.on_solver_error = on_solver_error
        self.fitness = Fitness(layers, num_experts, indicator, alpha_L, beta, q0)
        self.loads = {layer: LoadBounds(num_experts, gamma, alpha_adj, delta_ratio) for layer in self.layers}
        self.solver, self.widen_factor, self.max_widen, self.time_limit = solver, widen_factor, max_widen, time_limit

    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        """Solve every layer's program for ``devices`` (those with capacity >= 1).

        A solver exception under ``on_solver_error="greedy"`` is logged once per round at
        ERROR (the affected layers and the first exception's type and message; each
        traceback at DEBUG from :func:`solve_layer`) and recorded as
        ``Plan.info["status"] = "greedy_fallback"`` and ``Plan.info["solver_error"]``.

        Raises:
            Exception: the solver's exception, with ``on_solver_error="fail"``; the load
                bounds' state is then restored, so the round can be configured again.
        """
        devs = [d for d in devices if min(d.capacity, self.num_experts) >= 1]
        if not devs:
            return Plan({}, {"status": "no_devices"})
        ids = [d.device_id for d in devs]
        sizes = np.array([max(d.num_samples, 1) for d in devs], dtype=np.float64)
        k = np.array([min(d.capacity, self.num_experts) for d in devs], dtype=np.int64)
        rng = np.random.default_rng([self.seed, round])
        out: dict[str, dict[int, list[int]]] = {d: {} for d in ids}
        layers: dict[str, Any] = {}
        worst = "optimal"
        saved = {layer: lb.state_dict() for layer, lb in self.loads.items()}  # bounds() and record() mutate
        try:
            for layer in self.layers:
                t0 = time.perf_counter()
                b = self.loads[layer].bounds(sizes, k)
                x, info = solve_layer(self.fitness.matrix(layer, ids), sizes, k, b, self.solver, self.widen_factor,
                                      self.max_widen, self.time_limit, rng, self.on_solver_error)
                self.loads[layer].record(x, sizes, b.tau)
                info["seconds"] = time.perf_counter() - t0
                layers[str(layer)] = info
                worst = max(worst, info["status"], key=_RANK.__getitem__)
                for i, d in enumerate(ids):
                    out[d][layer] = np.flatnonzero(x[i]).tolist()
        except Exception:
            for layer, d in saved.items():
                self.loads[layer].load_state_dict(d)
            raise
        plan_info: dict[str, Any] = {"status": worst, "layers": layers}
        widened = {layer: info["widenings"] for layer, info in layers.items()
                   if info["status"] != "optimal" and "solver_error" not in info}
        if widened:
            log.warning("round %d: assignment program infeasible on %d of %d layer(s); bounds widened (widenings "
                        "per layer: %s)%s", round, len(widened), len(layers),
                        ", ".join(f"{lay}: {n}" for lay, n in widened.items()),
                        "; greedy top-k used where still infeasible" if worst == "greedy_fallback" else "")
        failed = [layer for layer, info in layers.items() if "solver_error" in info]
        if failed:
            plan_info["solver_error"] = layers[failed[0]]["solver_error"]
            log.error("round %d: assignment solver %s raised on layer(s) %s (%s); greedy top-k used there "
                      "(on_solver_error: greedy)", round, self.solver, ", ".join(failed), plan_info["solver_error"])
        return Plan(out, plan_info)

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        self.fitness.update(results)

    def state_dict(self) -> dict[str, Any]:
        return {"fitness": self.fitness.state_dict(),
                "loads": layers_to_json({layer: lb.state_dict() for layer, lb in self.loads.items()})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fitness.load_state_dict(state.get("fitness", {}))
        for layer, d in layers_from_json(state.get("loads", {})).items():
            if layer in self.loads:
                self.loads[layer].load_state_dict(d)
