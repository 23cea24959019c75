"""``load_balance``: the router load-balancing auxiliary loss of Switch Transformer
(Fedus et al. 2022, eq. 4) in its top-k form (as Mixtral is trained; transformers'
``load_balancing_loss_func``), over the experts this device holds.

Per MoE layer, over the batch's real tokens and the device's ``n`` held experts::

    f_j = (tokens whose top-k includes j) / (k · tokens)      fraction of routed slots
    P_j = mean over tokens of p(j | x)                          mean router probability
    L_aux = n · Σ_j f_j · P_j                                   (1 when perfectly balanced)
    L = L_task + α · mean over layers of L_aux

Why it is here (issue 15, FLEX-MoE Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 8): FLEX balances the
data volume each expert is *assigned*; what eq. 8 measures is the tokens each expert is
*routed*. A device that spreads its tokens over the experts it holds makes usage follow
assignment. The gradient flows into the router rows only through ``P_j`` (``f_j`` is
discrete), as in Switch.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import ObjectiveTerm, TermContext


def balance_loss(probs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """Switch eq. 4 (top-k form) for one layer.

    Args:
        probs: ``(N, n)`` routing probabilities over the held experts (with the graph).
        topk: ``(N, k)`` int64 local indices of each token's chosen experts.

    Returns:
        A scalar ``n · Σ_j f_j P_j`` (1.0 for uniform routing; up to ``n`` when every token
        goes to the same experts); 0 without tokens.
    """
    N, n = probs.shape
    if N == 0:
        return probs.sum() * 0.0
    f = torch.zeros(n, dtype=probs.dtype, device=probs.device).index_add_(
        0, topk.reshape(-1), torch.ones(topk.numel(), dtype=probs.dtype, device=probs.device)) / topk.numel()
    return n * (f * probs.mean(0)).sum()


class LoadBalanceTerm(ObjectiveTerm):
    """``α · L_aux`` (module docstring), averaged over the MoE layers.

    Params:
        alpha: weight α, >= 0 (default 0.01, Switch's value).

    Reports ``aux``: the mean ``L_aux`` over the round's steps (without α; 1 = balanced).

    Raises:
        ValueError: ``alpha`` not a number in [0, 1e6]; at a step, a MoE layer that
            recorded no routing (the device then fails the round with the reason).
    """

    name = "load_balance"

    def __init__(self, params: dict[str, Any], ctx: TermContext):
        super().__init__(params, ctx)
        self.alpha = self.param("alpha", 0.01, lo=0.0, hi=1e6)
        self._sum, self._steps = 0.0, 0

    def __call__(self, model: Any, batch: dict, logits: torch.Tensor) -> torch.Tensor:
        valid = model.model.token_mask(batch).reshape(-1)
        blocks = model.model.moe_blocks()
        total = logits.new_zeros(())
        for layer, block in sorted(blocks.items()):
            rec = block.last
            if rec is None:
                raise ValueError(f"objective {self.name!r}: MoE layer {layer} recorded no routing")
            total = total + balance_loss(rec.probs[valid], rec.topk_idx[valid])
        aux = total / max(len(blocks), 1)
        self._sum, self._steps = self._sum + float(aux.detach()), self._steps + 1
        return self.alpha * aux

    def statistics(self) -> dict[str, list[float]]:
        return {"aux": [self._sum / self._steps]} if self._steps else {}
