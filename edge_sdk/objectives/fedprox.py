"""``fedprox``: the FedProx proximal term (Li et al., 2020; docs/methods/baselines.md)."""

from __future__ import annotations

from typing import Any

import torch

from .base import ObjectiveTerm, TermContext


class ProximalTerm(ObjectiveTerm):
    """``mu/2 * sum_k ||w_k - w_k^start||²`` over the trainable adapter state, where
    ``w^start`` is the state the round started from.

    Params:
        mu: weight, >= 0 (required).
    """

    name = "fedprox"

    def __init__(self, params: dict[str, Any], ctx: TermContext):
        super().__init__(params, ctx)
        self.mu = self.param("mu", lo=0.0, hi=1e6)

    def __call__(self, model: Any, batch: dict, logits: torch.Tensor) -> torch.Tensor:
        total = logits.new_zeros(())
        for k, p in model.trainable().items():
            total = total + (p - self.ctx.start_state[k]).pow(2).sum()
        return 0.5 * self.mu * total
