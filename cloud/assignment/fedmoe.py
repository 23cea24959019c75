"""``fedmoe``: FedMoE's two-stage sub-model assignment (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304,
"Stage One" eq. 3 and "Stage Two" Algorithm 1 / eq. 4-6; docs/methods/fedmoe.md).

Stage one, per device, the first time it is selected:

1. A device whose budget holds the full MoE (``capacity == E``) gets the full MoE for a
   short probe (``Plan.train`` override ``max_steps = probe_steps``) and reports the
   activation probabilities p[l][e] of its validation split (``Stats.layers[*].
   activation_prob``). Its probe update is aggregated like any other.
2. A device that cannot hold the full MoE gets p estimated by :func:`estimate_p`: the
   sample-count-weighted mean of the probed devices of its task (all probed devices
   where none shares its task). If nobody has probed yet it gets a *provisional*
   sub-model from uniform p (random tie-break, as "w/o stage 1"), searched again once
   probe data exists.
3. :func:`search_threshold` (eq. 3) binary-searches the largest θ for which the
   smallest per-layer sets reaching Σp >= θ fit the memory limit
   :func:`headroom_limit`. The result is the device's initial entry of the
   client-expert map, which lives in this strategy's state (persisted by the round
   engine in the store as ``assignment_state``).

With ``own_p`` (not in the paper; docs/methods/fedmoe.md "Own p"), every device that is not
probing is asked for the ``router_probe`` objective term (protocol minor 11): it scores its own
validation tokens against every expert's router row and reports p over all E experts
(``Stats.extras`` ``router_probe.p.<layer>``). A device's first such report replaces the
estimated (or provisional) p it was searched with, its sub-model is searched again from it
the next time it is selected, and its later reports are the p stage two compares. Reports
that are not E finite values in [0, 1] per MoE layer summing to at most E are ignored.

Stage two, after every round (:meth:`FedMoE.observe`): expert recommendation
(:mod:`.recommendation`, eq. 4-6) for devices whose validation score stalled for
``patience`` rounds, exploratory (reverted and frozen when the next score does not
improve).

Choices where the paper is silent (documented here, docs/methods/fedmoe.md preamble):

- p is top-k counted (sums to top_k per layer), so it is renormalised per layer to
  sum 1 before the search; θ ∈ [0, 1] then means "share of routing mass kept".
- Every layer keeps at least ``min_experts`` (default 1) experts, also at θ = 0.
- α applies to the memory the *assignment* controls: limit = F + α·(M − F), where F
  is the memory of the same device holding no expert (runtime, backbone,
  activations; ``memory({l: []})``) and M the budget. The paper's α·M assumes
  experts dominate (Switch, 32 experts); on our upcycled MiniLM the fixed part is
  ~85% of the full MoE's estimate, so α on the whole budget would leave no room for
  any expert. Where F = 0 (hand-made tables) this is exactly α·M.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Mapping, Sequence

from edge_sdk.objectives.router_probe import RouterProbe
from protocol.messages import MIN_MINOR_FOR_ROUTER_PROBE, Objective
from protocol.experts import experts_by_device_from_json, experts_by_device_to_json, layers_from_json, \
    layers_to_json

from ..strategy import ClientResult, DeviceView, Experts, Failure, Plan
from . import recommendation as R
from .base import AssignmentStrategy

log = logging.getLogger(__name__)

Probs = dict[int, list[float]]
"""MoE layer -> activation probability per global expert (length E)."""


# --------------------------------------------------------------------------- stage one, pure functions


def normalise(p: Mapping[int, Sequence[float]]) -> Probs:
    """Per-layer renormalisation of activation probabilities to sum 1 (uniform where a
    layer's mass is 0). Raises ValueError on negative or non-finite entries."""
    out: Probs = {}
    for layer, row in p.items():
        vals = [float(x) for x in row]
        if any(not (x >= 0) or x == float("inf") for x in vals):
            raise ValueError(f"activation probabilities of layer {layer} must be finite and >= 0")
        s = sum(vals)
        out[int(layer)] = [x / s for x in vals] if s > 0 else [1.0 / len(vals)] * len(vals)
    return out


def smallest_sets(p: Mapping[int, Sequence[float]], theta: float, min_experts: int = 1,
                  order: Mapping[int, Sequence[int]] | None = None) -> Experts:
    """Per layer, the fewest experts (highest p first) whose summed p reaches ``theta``
    (eq. 3's first constraint), at least ``min_experts``.

    Args:
        p: layer -> p per expert, each layer summing to 1 (see :func:`normalise`).
        theta: threshold in [0, 1].
        order: layer -> tie-break rank per expert (lower first); default: expert id.

    Returns:
        layer -> sorted expert ids.
    """
    out: Experts = {}
    eps = 1e-12
    for layer, row in p.items():
        rank = order.get(layer) if order else None
        idx = sorted(range(len(row)), key=lambda e: (-row[e], rank[e] if rank else e))
        chosen, mass = [], 0.0
        for e in idx:
            if len(chosen) >= min_experts and mass >= theta - eps:
                break
            chosen.append(e)
            mass += row[e]
        out[layer] = sorted(chosen)
    return out


def headroom_limit(budget: int, fixed: int, alpha: float) -> float:
    """The memory limit of the search: ``fixed + alpha * (budget - fixed)`` bytes (see
    the module docstring). Raises ValueError unless 0 < alpha <= 1."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return fixed + alpha * max(budget - fixed, 0)


def search_threshold(p: Mapping[int, Sequence[float]], memory: Callable[[Experts], int], limit: float,
                     tol: float = 1e-3, min_experts: int = 1,
                     order: Mapping[int, Sequence[int]] | None = None) -> tuple[float, Experts] | None:
    """Heuristic sub-model search (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304 eq. 3): binary search for the
    largest θ in [0, 1] whose :func:`smallest_sets` fit ``memory(sets) <= limit``.

    Feasibility is monotone in θ (larger θ, superset), so bisection finds the largest
    feasible θ to within ``tol``.

    Args:
        p: layer -> activation probabilities per expert (renormalised here).
        memory: experts -> bytes (the SDK's memory estimate for this device).
        limit: bytes allowed (e.g. :func:`headroom_limit`).

    Returns:
        (θ, sets), or None when even ``min_experts`` per layer does not fit.
    """
    q = normalise(p)

    def fits(theta: float) -> Experts | None:
        sets = smallest_sets(q, theta, min_experts, order)
        return sets if memory(sets) <= limit else None

    best = fits(0.0)
    if best is None:
        return None
    top = fits(1.0)
    if top is not None:
        return 1.0, top
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        sets = fits(mid)
        if sets is not None:
            lo, best = mid, sets
        else:
            hi = mid
    return lo, best


def estimate_p(task: str, reports: Sequence[tuple[str, int, Mapping[int, Sequence[float]]]]) -> Probs | None:
    """Activation probabilities of a device that could not probe (FedMoE "Activation
    Probability Collection"): the mean of the probed devices' p weighted by their sample
    counts, over devices of the same ``task``, or over all when none shares it.

    Args:
        reports: ``(task, num_samples, p)`` of probed devices.

    Returns:
        layer -> estimated p, or None without any report.
    """
    same = [r for r in reports if r[0] == task]
    use = same or list(reports)
    if not use:
        return None
    total = sum(max(n, 0) for _, n, _ in use)
    weights = [(max(n, 0) / total) if total > 0 else 1.0 / len(use) for _, n, _ in use]
    out: Probs = {}
    for w, (_, _, p) in zip(weights, use):
        for layer, row in p.items():
            acc = out.setdefault(int(layer), [0.0] * len(row))
            for e, x in enumerate(row):
                acc[e] += w * float(x)
    return out


def _count(experts: Mapping[int, Sequence[int]]) -> int:
    return sum(len(v) for v in experts.values())


def _probs_of(result: ClientResult) -> Probs:
    return {ls.layer: list(ls.activation_prob) for ls in result.stats.layers}


ROUTER_PROBE = RouterProbe.name
"""The device-side objective term that measures p over every expert."""


def own_probs(extras: Mapping[str, Sequence[float]], layers: Sequence[int], num_experts: int) -> Probs | None:
    """A device's ``router_probe`` report (``Stats.extras`` ``router_probe.p.<layer>``) as p,
    or None where it is missing or out of bounds: every MoE layer present with ``num_experts``
    finite values in [0, 1] (each the share of tokens whose top-k includes the expert) whose sum
    is in (0, num_experts] (top-k counted shares sum to k)."""
    import math

    out: Probs = {}
    for layer in layers:
        v = extras.get(f"{ROUTER_PROBE}.p.{layer}")
        if v is None or len(v) != num_experts or not all(math.isfinite(x) and 0 <= x <= 1 + 1e-6 for x in v) \
                or not 0 < sum(v) <= num_experts * (1 + 1e-6):
            return None
        out[layer] = [float(x) for x in v]
    return out


# --------------------------------------------------------------------------- the strategy


class FedMoE(AssignmentStrategy):
    """FedMoE assignment (see the module docstring).

    Args:
        alpha: memory headroom factor of stage one (default 0.8).
        probe_steps: local steps of the full-MoE probe round.
        tol: bisection tolerance on θ.
        min_experts: experts every layer keeps.
        patience: rounds without a better validation score before a recommendation.
        similar: K, the number of similar devices consulted (eq. 5).
        stage1: False = "w/o stage 1": no probe, uniform p with a seeded random tie-break.
        stage2: False = "w/o stage 2": no expert recommendation.
        own_p: ask every device that is not probing for its own p over all experts
            (``router_probe``) and search its sub-model from that (see the module).
    """

    name = "fedmoe"

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, alpha: float = 0.8,
                 probe_steps: int = 5, tol: float = 1e-3, min_experts: int = 1, patience: int = 2,
                 similar: int = 3, stage1: bool = True, stage2: bool = True, own_p: bool = False, **params: Any):
        super().__init__(layers, num_experts, seed, **params)
        headroom_limit(1, 0, alpha)  # validates alpha
        if probe_steps < 1 or patience < 1 or similar < 1 or not 1 <= min_experts <= num_experts:
            raise ValueError("probe_steps, patience, similar must be >= 1 and 1 <= min_experts <= num_experts")
        self.alpha, self.probe_steps, self.tol, self.min_experts = alpha, probe_steps, tol, min_experts
        self.patience, self.similar, self.stage1, self.stage2 = patience, similar, stage1, stage2
        if not isinstance(own_p, bool):
            raise ValueError(f"own_p must be true or false, got {own_p!r}")
        self.own_p = own_p
        self.own: dict[str, Probs] = {}
        """device -> its latest own p (``router_probe``), when ``own_p``."""
        self.own_searched: set[str] = set()
        """Devices whose sub-model was searched from their own p."""
        self.map: dict[str, Experts] = {}
        """The client-expert map."""
        self.initial: dict[str, Experts] = {}
        self.theta: dict[str, float] = {}
        self.provisional: set[str] = set()
        self.probes: dict[str, dict[str, Any]] = {}
        """device -> {"task", "samples", "p"} from its full-MoE probe."""
        self.p: dict[str, Probs] = {}
        """device -> latest activation probabilities (reported, or estimated)."""
        self.meta: dict[str, dict[str, Any]] = {}
        """device -> {"task", "samples", "budget", "fixed"} as last seen."""
        self.best: dict[str, float] = {}
        self.stale: dict[str, int] = {}
        self.pending: dict[str, dict[str, Any]] = {}
        self.frozen: set[str] = set()
        self.history: list[dict[str, Any]] = []
        self._probing: set[str] = set()
        self._memory: dict[str, Callable[[Experts], int]] = {}

    # ------------------------------------------------------------------ helpers
    def _full(self) -> Experts:
        return {layer: list(range(self.num_experts)) for layer in self.layers}

    def _order(self, device_id: str) -> dict[int, list[int]]:
        rng = random.Random(f"{self.seed}/{device_id}/order")
        out = {}
        for layer in self.layers:
            perm = list(range(self.num_experts))
            rng.shuffle(perm)
            rank = [0] * self.num_experts
            for r, e in enumerate(perm):
                rank[e] = r
            out[layer] = rank
        return out

    def _memory_of(self, d: DeviceView) -> Callable[[Experts], int]:
        if d.memory is not None:
            return d.memory
        # No memory model: count experts against the uniform capacity.
        return lambda ex, cap=d.capacity, L=len(self.layers), b=d.budget_bytes: (
            int(b * _count(ex) / max(cap * L, 1)) if cap > 0 else b + 1)

    def _limit(self, d: DeviceView, memory: Callable[[Experts], int], alpha: float | None = None) -> float:
        fixed = memory({layer: [] for layer in self.layers})
        return headroom_limit(d.budget_bytes, min(fixed, d.budget_bytes), self.alpha if alpha is None else alpha)

    def _uniform(self) -> Probs:
        return {layer: [1.0 / self.num_experts] * self.num_experts for layer in self.layers}

    def _reports(self, exclude: str) -> list[tuple[str, int, Probs]]:
        return [(r["task"], r["samples"], r["p"]) for d, r in sorted(self.probes.items()) if d != exclude]

    def _search(self, d: DeviceView, p: Probs, memory: Callable[[Experts], int]) -> tuple[float, Experts] | None:
        p = {layer: p.get(layer, [0.0] * self.num_experts) for layer in self.layers}
        return search_threshold(p, memory, self._limit(d, memory), self.tol, self.min_experts, self._order(d.device_id))

    # ------------------------------------------------------------------ configure
    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        plan = Plan({}, {"probing": [], "searched": {}, "left_out": []})
        for d in devices:
            memory = self._memory_of(d)
            self._memory[d.device_id] = memory
            self.meta[d.device_id] = {"task": d.task, "samples": d.num_samples, "budget": d.budget_bytes}
            experts = self._stage_one(d, memory, plan)
            if experts is None:
                continue
            if memory(experts) > d.budget_bytes:  # budget changed since the map was made: search again
                found = self._search(d, self.p.get(d.device_id) or self._uniform(), memory)
                if found is None:
                    plan.info["left_out"].append(d.device_id)
                    continue
                self.theta[d.device_id], experts = found
                self.map[d.device_id] = experts
            plan.assignments[d.device_id] = {k: sorted(v) for k, v in experts.items()}
            if self.own_p and d.device_id not in self._probing and d.protocol_minor >= MIN_MINOR_FOR_ROUTER_PROBE:
                plan.objectives[d.device_id] = [Objective(name=ROUTER_PROBE)]
        counts = [_count(e) for e in self.map.values()]
        plan.info["experts_mean"] = sum(counts) / len(counts) if counts else None
        plan.info["experts_min"] = min(counts) if counts else None
        plan.info["experts_max"] = max(counts) if counts else None
        if not plan.info["probing"]:
            del plan.info["probing"]
        if not plan.info["left_out"]:
            del plan.info["left_out"]
        return plan

    def _stage_one(self, d: DeviceView, memory: Callable[[Experts], int], plan: Plan) -> Experts | None:
        dev = d.device_id
        redo = dev not in self.pending and (dev in self.provisional and (self.probes or not self.stage1)
                                            or dev in self.own and dev not in self.own_searched)
        if dev in self.map and not redo:
            return self.map[dev]
        if self.stage1 and dev not in self.probes and d.capacity >= self.num_experts \
                and memory(self._full()) <= d.budget_bytes:
            self._probing.add(dev)
            plan.info["probing"].append(dev)
            plan.train[dev] = {"max_steps": self.probe_steps}
            return self._full()
        if dev in self.own:
            p, how = self.own[dev], "own"
            self.own_searched.add(dev)
        elif not self.stage1:
            p, how = self._uniform(), "uniform (w/o stage 1)"
        elif dev in self.probes:
            p, how = self.probes[dev]["p"], "probe"
        else:
            est = estimate_p(d.task, self._reports(dev))
            p, how = (est, "estimated") if est is not None else (self._uniform(), "provisional")
        found = self._search(d, p, memory)
        if found is None:
            log.warning("fedmoe: %s cannot hold %d expert(s) per layer within its budget; left out",
                        dev, self.min_experts)
            plan.info["left_out"].append(dev)
            return None
        theta, experts = found
        self.theta[dev], self.map[dev], self.initial[dev] = theta, experts, experts
        self.p.setdefault(dev, p)
        if how == "provisional":
            self.provisional.add(dev)
        else:
            self.provisional.discard(dev)
            if how in ("estimated", "own"):
                self.p[dev] = p
        plan.info["searched"][dev] = {"theta": round(theta, 4), "experts": _count(experts), "p": how}
        log.info("fedmoe: %s initial sub-model from %s p: theta %.3f, %d experts %s", dev, how, theta,
                 _count(experts), {k: len(v) for k, v in experts.items()})
        return experts

    # ------------------------------------------------------------------ observe (stage two)
    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        events: list[dict[str, Any]] = []
        for r in results:
            dev = r.device_id
            self.meta.setdefault(dev, {}).update({"task": r.task, "samples": r.num_samples})
            p = _probs_of(r)
            own = own_probs(r.stats.extras, self.layers, self.num_experts) if self.own_p else None
            if own is not None:
                self.own[dev] = p = own
            elif self.own_p and any(k.startswith(ROUTER_PROBE + ".") for k in r.stats.extras):
                log.warning("fedmoe: %s's router_probe report is out of bounds; ignored", dev)
            if dev in self._probing:
                self.probes[dev] = {"task": r.task, "samples": r.num_samples, "p": p}
                self.p[dev] = p
                continue
            self.p[dev] = p
            if dev not in self.map or r.stats.val_accuracy is None or not self.stage2:
                continue
            score = float(r.stats.val_accuracy)
            if dev in self.pending:
                pend = self.pending.pop(dev)
                if score > pend["score_before"]:
                    self.best[dev], self.stale[dev] = score, 0
                    events.append({"device": dev, "event": "kept", "score": score})
                else:
                    self.map[dev] = Experts.from_json(pend["previous"])
                    self.frozen.add(dev)
                    events.append({"device": dev, "event": "reverted", "score": score,
                                   "score_before": pend["score_before"]})
                continue
            if score > self.best.get(dev, float("-inf")):
                self.best[dev], self.stale[dev] = score, 0
                continue
            self.stale[dev] = self.stale.get(dev, 0) + 1
            if self.stale[dev] < self.patience or dev in self.frozen:
                continue
            self.stale[dev] = 0
            change = self._recommend(dev)
            if change is not None:
                events.append({"device": dev, "event": "recommended", **change})
        self._probing -= {r.device_id for r in results} | {f.device_id for f in failures}
        if events:
            self.history.append({"round": round, "events": events})

    def _recommend(self, dev: str) -> dict[str, Any] | None:
        own = self.map[dev]
        others = {d: self.p[d] for d in self.map if d != dev and d in self.p}
        if dev not in self.p or not others:
            return None
        counts = {d: _count(self.map[d]) for d in others}
        memory = self._memory.get(dev)
        budget = self.meta.get(dev, {}).get("budget")
        fits = (lambda ex: memory(ex) <= budget) if memory is not None and budget is not None else (lambda ex: True)
        new = R.recommend(self.p[dev], own, others, counts, self.similar, fits, self.min_experts)
        if new is None or new == own:
            return None
        self.pending[dev] = {"previous": Experts(own).to_json(), "score_before": self.best.get(dev, 0.0)}
        self.map[dev] = new
        log.info("fedmoe: recommendation for %s: %d -> %d experts", dev, _count(own), _count(new))
        return {"before": _count(own), "after": _count(new)}

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        return {
            "map": experts_by_device_to_json(self.map), "initial": experts_by_device_to_json(self.initial),
            "theta": self.theta, "provisional": sorted(self.provisional),
            "probes": {d: {**r, "p": layers_to_json(r["p"])} for d, r in self.probes.items()},
            "p": {d: layers_to_json(p) for d, p in self.p.items()}, "meta": self.meta, "best": self.best,
            "stale": self.stale, "pending": self.pending, "frozen": sorted(self.frozen),
            "probing": sorted(self._probing), "history": self.history[-200:],
            "own": {d: layers_to_json(p) for d, p in self.own.items()}, "own_searched": sorted(self.own_searched),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.map = experts_by_device_from_json(state.get("map", {}))
        self.initial = experts_by_device_from_json(state.get("initial", {}))
        self.theta = dict(state.get("theta", {}))
        self.provisional = set(state.get("provisional", []))
        self.probes = {d: {**r, "p": layers_from_json(r["p"])} for d, r in state.get("probes", {}).items()}
        self.p = {d: layers_from_json(p) for d, p in state.get("p", {}).items()}
        self.meta, self.best = dict(state.get("meta", {})), dict(state.get("best", {}))
        self.stale, self.pending = dict(state.get("stale", {})), dict(state.get("pending", {}))
        self.frozen, self._probing = set(state.get("frozen", [])), set(state.get("probing", []))
        self.history = list(state.get("history", []))
        self.own = {d: layers_from_json(p) for d, p in state.get("own", {}).items()}
        self.own_searched = set(state.get("own_searched", []))
