"""``fedalign_align``: FedAlign-MoE's routing regulariser on the device
(Fang et al. 2026, "Aggregation Alignment for Federated Learning with Mixture-of-Experts under Data Heterogeneity" (FedAlign-MoE), arXiv:2603.21276 Sec. III-C3, eq. 8-11 as reconstructed in docs/methods/fedalign-moe.md).

Per MoE layer and training token x, over the experts this device holds:

    L_reg(x) = Σ_{e ∈ TopK(x) ∪ G} λ_c[e] · r_g[e] · log(r_g[e] / p(e|x))     (eq. 8, 10)
    G = {e : r_g[e] >= 1/n}                                                  (globally prominent)
    λ_c[e] = sigmoid((O_c[e] − τ_O) / T_O),  O_c[e] = r_c[e] · r_g[e]         (eq. 4, 9)
    L = L_task + μ · mean over layers and real tokens of L_reg(x)             (eq. 11)

Choices where the paper is silent (documented in
``cloud/strategies/fedalign.py`` too):

- The cloud sends ``r_g`` for all E experts (tensor :data:`RG_TENSOR`, ``(L, E)``, rows in
  ascending MoE layer order). A sub-MoE's softmax runs over its n held experts only, so
  ``r_g`` is restricted to them and renormalised; G uses ``1/n``.
- ``r_c`` for λ is this round's running mean of the top-k-renormalised routing weights
  (eq. 3) over the tokens trained on so far, this batch included (detached); τ_O is the
  mean of ``O_c`` over the held experts unless ``tau_o`` is given; ``T_O = t_o_factor · τ_O``.
- ``p(e|x)`` is recomputed from the router rows and the *detached* layer input the block
  recorded (``train.collect_hidden``), so the gradient reaches the router rows only, never
  the experts or earlier layers: the regulariser aligns the gating network.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moe_model.stats import routing_mass

from .base import ObjectiveTerm, TermContext

RG_TENSOR = "fedalign.r_g"
"""Name of the extra tensor carrying the global routing distribution, ``(L, E)`` float32."""
SUM_TOLERANCE = 1e-3
"""How far a row of ``r_g`` may sum from 1."""


def adaptive_weights(r_c: torch.Tensor, r_g: torch.Tensor, tau_o: float | None = None,
                     t_o_factor: float = 0.1) -> torch.Tensor:
    """Eq. 4 and 9: ``λ[e] = sigmoid((r_c[e]·r_g[e] − τ_O) / T_O)``.

    Args:
        r_c: ``(n,)`` the device's routing distribution over its held experts.
        r_g: ``(n,)`` the global one, restricted to them.
        tau_o: the overlap threshold τ_O; None: the mean overlap.
        t_o_factor: ``T_O = t_o_factor · τ_O`` (at least 1e-12).

    Returns:
        ``(n,)`` in (0, 1), increasing in the overlap.
    """
    overlap = r_c * r_g
    tau = overlap.mean() if tau_o is None else torch.as_tensor(float(tau_o), dtype=overlap.dtype)
    return torch.sigmoid((overlap - tau) / (t_o_factor * tau).clamp_min(1e-12))


def held_reference(r_g: torch.Tensor, held: list[int]) -> torch.Tensor:
    """``r_g`` ``(E,)`` restricted to the ``held`` global expert ids and renormalised
    (uniform when it gives them no mass); ``(n,)``."""
    r = r_g[held].double()
    return r / r.sum() if r.sum() > 0 else torch.full_like(r, 1.0 / len(held))


def alignment_loss(logp: torch.Tensor, topk: torch.Tensor, r_g: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Eq. 10 for one layer: the mean over tokens of
    ``Σ_{e ∈ TopK(x) ∪ G} λ[e] r_g[e] (log r_g[e] − log p(e|x))``, ``G = {e : r_g[e] >= 1/n}``.

    Args:
        logp: ``(N, n)`` log routing probabilities (with the graph the gradient follows).
        topk: ``(N, k)`` int64 local indices of each token's chosen experts.
        r_g: ``(n,)`` reference distribution over the held experts (0·log 0 = 0).
        lam: ``(n,)`` per-expert weights λ.

    Returns:
        A scalar (0 without tokens).
    """
    if logp.shape[0] == 0:
        return logp.sum() * 0.0
    r = r_g.to(logp.dtype)
    chosen = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, topk, True) | (r >= 1.0 / r.numel())
    per = (lam.to(logp.dtype) * (torch.xlogy(r, r) - r * logp)) * chosen
    return per.sum(1).mean()


class AlignTerm(ObjectiveTerm):
    """FedAlign-MoE routing regulariser (eq. 8-11), ``μ · L_reg``.

    Params:
        mu: weight μ, >= 0 (default 0.01).
        adaptive: False: λ = 1 (the paper's ablation without adaptive expert weights).
        tau_o: the overlap threshold τ_O, >= 0 (default: the mean overlap).
        t_o_factor: ``T_O = t_o_factor · τ_O``, > 0 (default 0.1).

    Needs the extra tensor :data:`RG_TENSOR` (``(L, E)``, finite, non-negative rows summing
    to 1) and ``train.collect_hidden`` (the recorded layer input). Reports ``reg``: the mean
    ``L_reg`` over the round's steps (without μ).

    Raises:
        ValueError: invalid parameters, the tensor missing or ill-formed, or
            ``collect_hidden`` off; in :meth:`before_training`, ``r_g``'s shape does not fit
            the model. The device then refuses the round with the reason.
    """

    name = "fedalign_align"

    def __init__(self, params: dict[str, Any], ctx: TermContext):
        super().__init__(params, ctx)
        self.mu = self.param("mu", 0.01, lo=0.0, hi=1e6)
        self.t_o_factor = self.param("t_o_factor", 0.1, lo=1e-12, hi=1e6)
        self.tau_o = self.param("tau_o", lo=0.0, hi=1.0) if params.get("tau_o") is not None else None
        self.adaptive = params.get("adaptive", True)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"objective {self.name!r}: parameter 'adaptive' must be true or false")
        if not ctx.train.collect_hidden:
            raise ValueError(f"objective {self.name!r} needs train.collect_hidden (it recomputes the routing "
                             f"from the recorded layer input)")
        r_g = ctx.tensors.get(RG_TENSOR)
        if r_g is None or r_g.dim() != 2 or r_g.shape[1] == 0:
            raise ValueError(f"objective {self.name!r} needs the extra tensor {RG_TENSOR} of shape (layers, experts), "
                             f"got {None if r_g is None else tuple(r_g.shape)}")
        r_g = r_g.double()
        if not torch.isfinite(r_g).all() or (r_g < 0).any() or \
                ((r_g.sum(1) - 1).abs() > SUM_TOLERANCE).any():
            raise ValueError(f"objective {self.name!r}: {RG_TENSOR} must be finite, non-negative, and each row must "
                             f"sum to 1")
        self.r_g = r_g
        self._route: dict[int, torch.Tensor] = {}
        self._tokens: dict[int, int] = {}
        self._sum, self._steps = 0.0, 0

    def before_training(self, model: Any) -> None:
        blocks, E = model.model.moe_blocks(), model.spec.num_experts
        if tuple(self.r_g.shape) != (len(blocks), E):
            raise ValueError(f"objective {self.name!r}: {RG_TENSOR} has shape {tuple(self.r_g.shape)}, the model "
                             f"has {len(blocks)} MoE layers of {E} experts")

    def __call__(self, model: Any, batch: dict, logits: torch.Tensor) -> torch.Tensor:
        valid = model.model.token_mask(batch).reshape(-1)
        blocks = sorted(model.model.moe_blocks().items())
        total = logits.new_zeros(())
        for row, (layer, block) in enumerate(blocks):
            rec = block.last
            if rec is None or rec.hidden is None:
                raise ValueError(f"objective {self.name!r}: MoE layer {layer} recorded no layer input")
            x, topk, held = rec.hidden[valid], rec.topk_idx[valid], block.expert_ids
            route = routing_mass(topk, rec.topk_weight[valid], len(held)).sum(0)
            self._route[layer] = self._route.get(layer, 0) + route
            self._tokens[layer] = self._tokens.get(layer, 0) + x.shape[0]
            r_g = held_reference(self.r_g[row], held)
            lam = torch.ones_like(r_g)
            if self.adaptive and self._tokens[layer]:
                lam = adaptive_weights(self._route[layer] / self._tokens[layer], r_g, self.tau_o, self.t_o_factor)
            logp = F.log_softmax(block.router(x.detach().float()).float(), dim=-1)
            total = total + alignment_loss(logp, topk, r_g, lam)
        reg = total / max(len(blocks), 1)
        self._sum, self._steps = self._sum + float(reg.detach()), self._steps + 1
        return self.mu * reg

    def statistics(self) -> dict[str, list[float]]:
        return {"reg": [self._sum / self._steps]} if self._steps else {}
