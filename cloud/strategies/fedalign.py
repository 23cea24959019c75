"""``fedalign``: FedAlign-MoE (Fang et al. 2026, "Aggregation Alignment for Federated Learning with Mixture-of-Experts under Data Heterogeneity" (FedAlign-MoE), arXiv:2603.21276; docs/methods/fedalign-moe.md, whose
equations are reconstructed from the paper's text), on top of any assignment part.

Per round, for every MoE layer l (E experts; C devices that trained):

- **Gating distribution alignment** (Sec. III-C, eq. 3-7). Devices report r_c (eq. 3)
  and the routing margins M_c (eq. 5) in ``LayerStats.routing_dist`` / ``.margin``. The
  cloud keeps the global routing distribution r_g ``(L, E)`` as its owned tensor
  :data:`RG_TENSOR` (uniform 1/E before round 1) and updates it by :func:`global_routing`:
  O_c = r_c·r_g (eq. 4), w_c = O_c·M_c (eq. 6), r_g[e] = Σ_c w_c r_c / Σ_c w_c (eq. 7).
  Each round every device gets r_g as an extra tensor and the objective term
  ``fedalign_align`` (eq. 8-11, :mod:`edge_sdk.objectives.fedalign_align`, with μ, τ_O, T_O).
- **Semantic-aware expert aggregation** (Sec. III-D, eq. 12-18). Devices report h_c[e]
  (eq. 12, ``LayerStats.hidden_mean``; the plan asks for it with ``collect_hidden``); each
  expert's tensors become θ[e] + Σ_c ω_c Δθ_c / Σ_c ω_c with the weights of
  :func:`client_weights`.
- **Everything else** (backbone LoRA, task heads, router rows) is the configured
  aggregation part's (default ``modular``: FedAvg over holders), wrapped by the aggregator in
  a robust rule if configured. the paper is silent on router rows; it aligns
  gating *behaviour* through the regulariser and reads as keeping gating networks local.
  We average the rows (the global model the cloud evaluates and a device joining later
  need a router), and ``train.router: private`` gives the paper's reading (rows stay on
  the devices, ``private_router`` term; the regulariser then aligns the private rows).

Choices where the paper is silent:

- A device counts for expert e only if it held e and routed tokens to it (``usage > 0``,
  so it reported h_c[e]): a holder that never used e did not train it. r_g[e] for an
  expert no device held this round keeps its previous value before renormalising; r_c of
  a device holding few experts sums to 1 over those (its sub-MoE's softmax), as is.
- μ_e and σ_e (eq. 16) are the mean and population std over unordered pairs; with two
  participants σ_e = 0, so s*_e = s and every gate is sigmoid(0) = 0.5: the adaptive
  threshold filters only with three or more.
- Eq. 15 weighs updates by ω only (no |D_c|), as reconstructed.
- DP-FedAvg cannot replace the semantic expert aggregation (its guarantee would not
  hold): with ``defences.dp`` set, use ``semantic_aggregation: false``.

Ablations (the paper's Fig. 13-14): ``router_alignment: false`` (plain router averaging,
no regulariser), ``consistency_weighting: false`` (r_g the unweighted mean of r_c),
``adaptive_lambda: false`` (λ = 1), ``semantic_aggregation: false`` (experts by the
aggregation part), ``direction_consensus: false`` (d = 1), ``threshold: <s*>`` (a fixed
threshold instead of eq. 17).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from edge_sdk.objectives.fedalign_align import RG_TENSOR, SUM_TOLERANCE, AlignTerm
from protocol import keys
from protocol.experts import layers_from_json, layers_to_json
from protocol.messages import Objective, Stats

from ..strategy import Aggregated, ClientResult, DeviceView, Failure, Plan, Setup
from .composed import Composed

if TYPE_CHECKING:
    from ..global_model import GlobalModel

log = logging.getLogger(__name__)
_TINY = torch.finfo(torch.float64).tiny


def global_routing(previous: torch.Tensor, routing: torch.Tensor, margin: torch.Tensor, held: torch.Tensor,
                   samples: torch.Tensor, weighted: bool = True) -> torch.Tensor:
    """Eq. 4-7 for one layer: the next global routing distribution.

    Args:
        previous: ``(E,)`` r_g of the last round.
        routing: ``(C, E)`` the devices' r_c (eq. 3).
        margin: ``(C, E)`` their margins M_c (eq. 5).
        held: ``(C, E)`` bool, device c counts for expert e.
        samples: ``(C,)`` |D_c|.
        weighted: False: the unweighted mean of the r_c (ablation).

    Returns:
        ``(E,)`` float64 summing to 1: Σ_c w_c r_c / Σ_c w_c with w_c = r_c·r_g·M_c
        (eq. 4, 6, 7); where the weights sum to 0, the |D_c|-weighted mean over the devices
        counting for e; where none does, ``previous``; then renormalised (uniform if all 0).
    """
    mask = held.double()
    r = routing.double() * mask
    w = r * previous.double() * margin.double() if weighted else mask
    den, fallback = w.sum(0), mask * samples.double()[:, None]
    fden = fallback.sum(0)
    out = torch.where(den > 0, (w * r).sum(0) / den.clamp_min(_TINY),
                      torch.where(fden > 0, (fallback * r).sum(0) / fden.clamp_min(_TINY), previous.double()))
    total = out.sum()
    return out / total if total > 0 else torch.full_like(out, 1.0 / out.numel())


def cosines(x: torch.Tensor) -> torch.Tensor:
    """``(n, P)`` -> ``(n, n)`` pairwise cosine similarities of the rows (0 with a zero row)."""
    x = x.double()
    norm = x.norm(dim=1, keepdim=True)
    u = torch.where(norm > 0, x / norm.clamp_min(_TINY), torch.zeros_like(x))
    return u @ u.t()


def client_weights(deltas: torch.Tensor, hidden: torch.Tensor, zeta: float = 1.0, t_s: float = 0.05,
                   threshold: float | None = None, consensus: bool = True) -> torch.Tensor:
    """Eq. 13-18 for one expert: each participant's aggregation weight ω_c.

    Args:
        deltas: ``(n, P)`` the participants' flattened updates Δθ_c of the expert.
        hidden: ``(n, H)`` their input-space assignments h_c (eq. 12).
        zeta: ζ of the adaptive threshold s* = μ − ζ·σ (eq. 17).
        t_s: the gate temperature T_s (eq. 18).
        threshold: a fixed s* instead of eq. 16-17 (ablation).
        consensus: False: direction consensus d = 1 (ablation).

    Returns:
        ``(n,)`` float64: ω_c = Σ_{c'≠c} sigmoid((s_cc' − s*)/T_s)·max(0, d_cc') with
        s = cos(h_c, h_c') (eq. 16) and d = cos(Δθ_c, Δθ_c') (eq. 13); ``[1]`` for a lone
        participant (eq. 15).
    """
    n = deltas.shape[0]
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    s = cosines(hidden)
    d = cosines(deltas).clamp_min(0) if consensus else torch.ones_like(s)
    if threshold is None:
        pairs = s[torch.triu(torch.ones(n, n, dtype=torch.bool), 1)]
        s_star = pairs.mean() - zeta * pairs.std(unbiased=False)
    else:
        s_star = torch.tensor(float(threshold), dtype=torch.float64)
    a = torch.sigmoid((s - s_star) / t_s) * d
    return (a * (1 - torch.eye(n, dtype=torch.float64))).sum(1)


class FedAlign(Composed):
    """FedAlign-MoE (see the module docstring) with the configured assignment part.

    Params (paper defaults): ``mu`` 0.01 (μ, eq. 11), ``tau_o`` None (τ_O; None: the mean
    overlap), ``t_o_factor`` 0.1 (T_O = 0.1·τ_O), ``zeta`` 1.0 (ζ, eq. 17), ``t_s`` 0.05
    (T_s, eq. 18); ablation switches ``router_alignment``, ``consistency_weighting``,
    ``adaptive_lambda``, ``semantic_aggregation``, ``direction_consensus`` (all true) and
    ``threshold`` (None: adaptive).

    Raises:
        ValueError: a parameter out of range. TypeError: unknown parameters.
    """

    name = "fedalign"

    def __init__(self, setup: Setup, mu: float = 0.01, tau_o: float | None = None, t_o_factor: float = 0.1,
                 zeta: float = 1.0, t_s: float = 0.05, router_alignment: bool = True,
                 consistency_weighting: bool = True, adaptive_lambda: bool = True, semantic_aggregation: bool = True,
                 direction_consensus: bool = True, threshold: float | None = None, **params: Any):
        super().__init__(setup, **params)
        flags = dict(router_alignment=router_alignment, consistency_weighting=consistency_weighting,
                     adaptive_lambda=adaptive_lambda, semantic_aggregation=semantic_aggregation,
                     direction_consensus=direction_consensus)
        bad = [k for k, v in flags.items() if not isinstance(v, bool)]
        for k, v, ok in (("mu", mu, lambda x: x >= 0), ("t_o_factor", t_o_factor, lambda x: x > 0),
                         ("zeta", zeta, lambda x: x >= 0), ("t_s", t_s, lambda x: x > 0),
                         ("tau_o", tau_o, lambda x: 0 <= x <= 1), ("threshold", threshold, lambda x: -1 <= x <= 1)):
            if v is None and k in ("tau_o", "threshold"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                bad.append(k)
        if bad:
            raise ValueError(f"fedalign: invalid parameters {bad} (mu >= 0, t_o_factor > 0, zeta >= 0, t_s > 0, "
                             f"tau_o in [0, 1], threshold in [-1, 1], switches true/false)")
        self.mu, self.tau_o, self.t_o_factor, self.zeta, self.t_s = mu, tau_o, t_o_factor, zeta, t_s
        self.threshold = threshold
        for k, v in flags.items():
            setattr(self, k, v)
        self._part, self._warned = self.aggregation, False
        self.hidden: dict[int, int] = {}
        """MoE layer -> hidden size (the router rows' length), from the global model."""

    @property
    def wants_hidden(self) -> bool:
        """Whether devices are asked for h_c (semantic aggregation, and the regulariser's router input)."""
        return self.semantic_aggregation or self.router_alignment

    def routing(self, model: "GlobalModel") -> torch.Tensor:
        """r_g ``(L, E)`` float32 (rows: MoE layers ascending): the owned tensor, uniform before round 1."""
        E = self.setup.num_experts
        return model.owned.get(RG_TENSOR, torch.full((len(model.layers), E), 1.0 / E))

    def configure_round(self, round: int, devices: list[DeviceView], model: "GlobalModel") -> Plan:
        """The assignment part's plan, plus ``collect_hidden``, r_g and the regulariser per device."""
        if self.semantic_aggregation and self.aggregation is not self._part:
            if getattr(self.aggregation, "inner", None) is not self._part:
                raise ValueError("fedalign's semantic expert aggregation cannot run under DP-FedAvg (the guarantee "
                                 "would not hold for experts); set semantic_aggregation: false")
            if not self._warned:
                self._warned = True
                log.warning("fedalign: the robust rule applies to router rows and non-expert tensors; experts are "
                            "aggregated semantically (screening and the guard still apply)")
        self.hidden = {k.layer: int(v.shape[0]) for name, v in model.state.items()
                       if (k := keys.parse(name)).group == "router"}
        plan = super().configure_round(round, devices, model)
        r_g = self.routing(model)
        term = Objective(name=AlignTerm.name, params={
            "mu": self.mu, "t_o_factor": self.t_o_factor, "adaptive": self.adaptive_lambda,
            **({"tau_o": self.tau_o} if self.tau_o is not None else {})})
        for d in plan.assignments:
            if self.wants_hidden:
                plan.train[d] = {**plan.train.get(d, {}), "collect_hidden": True}
            if self.router_alignment:
                plan.tensors[d] = {**plan.tensors.get(d, {}), RG_TENSOR: r_g}
                plan.objectives[d] = [*plan.objectives.get(d, []), term]
        return plan

    def stats_problem(self, device_id: str, stats: Stats) -> str | None:
        """Bounds on what fedalign reads (the engine already bounded usage to held
        experts): per layer, r_c and M_c finite, 0 for experts without usage, r_c summing to
        1 (all 0 without tokens); with ``collect_hidden`` asked, h_c finite of the router's
        hidden size for every expert with usage."""
        E = self.setup.num_experts
        if sorted(ls.layer for ls in stats.layers) != sorted(self.setup.layers):
            return f"fedalign: layers {[ls.layer for ls in stats.layers]} differ from {sorted(self.setup.layers)}"
        for ls in stats.layers:
            where = f"fedalign: layer {ls.layer}"
            r, m, used = ls.routing_dist, ls.margin, [u > 0 for u in ls.usage]
            if not len(r) == len(m) == len(used) == E:
                return f"{where}: routing_dist/margin/usage must have {E} entries"
            if not all(math.isfinite(x) and 0 <= x <= 1 for x in (*r, *m)):
                return f"{where}: routing_dist and margin must be finite, in [0, 1]"
            if any((x > 0 or y > 0) and not u for x, y, u in zip(r, m, used)):
                return f"{where}: routing_dist or margin for an expert with no usage"
            if abs(sum(r) - (1.0 if ls.tokens > 0 else 0.0)) > SUM_TOLERANCE:
                return f"{where}: routing_dist sums to {sum(r):.6g}, not {1 if ls.tokens > 0 else 0}"
            if self.wants_hidden and any(used):
                size, h = self.hidden.get(ls.layer), ls.hidden_mean
                if h is None or any(u and (h[e] is None or (size is not None and len(h[e]) != size)
                                           or not all(math.isfinite(x) for x in h[e]))
                                    for e, u in enumerate(used)):
                    return f"{where}: hidden_mean must give a finite vector of size {size} for every expert used"
        return None

    def aggregate(self, round: int, model: "GlobalModel", results: list[ClientResult],
                  failures: list[Failure]) -> Aggregated:
        """Router rows and non-expert tensors by the aggregation part, experts by eq. 13-18,
        the next r_g by eq. 4-7."""
        state = dict(super().aggregate(round, model, results, failures).state)
        counts = {"aggregated": 0, "unchanged": 0}
        if self.semantic_aggregation:
            counts = self._experts(model.state, results, state)
        r_g = self.routing(model).clone()
        for row, layer in enumerate(sorted(model.layers)):
            trained = [(r, ls) for r in results for ls in r.stats.layers if ls.layer == layer and ls.tokens > 0]
            if not trained:
                continue
            used = torch.tensor([[u > 0 for u in ls.usage] for _, ls in trained])
            r_g[row] = global_routing(r_g[row], torch.tensor([ls.routing_dist for _, ls in trained]),
                                      torch.tensor([ls.margin for _, ls in trained]), used,
                                      torch.tensor([float(r.num_samples) for r, _ in trained]),
                                      self.consistency_weighting).float()
        metrics = {"r_g": {str(layer): r_g[row].tolist() for row, layer in enumerate(sorted(model.layers))},
                   "experts": counts,
                   "regulariser": {r.device_id: r.stats.extras[f"{AlignTerm.name}.reg"][0] for r in results
                                   if len(r.stats.extras.get(f"{AlignTerm.name}.reg", ())) == 1}}
        return Aggregated(state, {**model.owned, RG_TENSOR: r_g}, metrics)

    def _experts(self, before: dict[str, torch.Tensor], results: list[ClientResult],
                 state: dict[str, torch.Tensor]) -> dict[str, int]:
        """Set each expert's tensors in ``state`` by eq. 15 over the devices that used it
        (unchanged without one, or when every ω is 0)."""
        counts = {"aggregated": 0, "unchanged": 0}
        for unit, names in keys.units(before).items():
            names = [k for k in names if keys.parse(k).group == "expert"]
            if unit[0] != "expert" or not names:
                continue
            _, layer, e = unit
            part = [(r, h) for r in results if all(k in r.state for k in names)
                    and (h := _hidden(r.stats, layer, e)) is not None]
            deltas = torch.stack([torch.cat([(r.state[k].double() - before[k].double()).reshape(-1) for k in names])
                                  for r, _ in part]) if part else None
            omega = None if deltas is None else client_weights(
                deltas, torch.tensor([h for _, h in part], dtype=torch.float64), self.zeta, self.t_s, self.threshold,
                self.direction_consensus)
            if omega is None or float(omega.sum()) <= 0:
                state.update({k: before[k] for k in names})
                counts["unchanged"] += 1
                continue
            step, at = (omega[:, None] * deltas).sum(0) / omega.sum(), 0
            for k in names:
                n = before[k].numel()
                state[k] = (before[k].double() + step[at:at + n].view(before[k].shape)).to(before[k].dtype)
                at += n
            counts["aggregated"] += 1
        return counts

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "hidden": layers_to_json(self.hidden)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.hidden = {layer: int(v) for layer, v in layers_from_json(state.get("hidden", {})).items()}


def _hidden(stats: Stats, layer: int, expert: int) -> list[float] | None:
    """h_c[e] of a device that routed tokens to ``expert`` in ``layer``, else None."""
    for ls in stats.layers:
        if ls.layer == layer and ls.usage[expert] > 0 and ls.hidden_mean is not None:
            return ls.hidden_mean[expert]
    return None
