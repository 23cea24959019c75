"""``private_router``: client-private gating (FLEX-MoE, Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070
Step 3; docs/methods/flex-moe.md). The device keeps the router rows it trained and uses them
instead of the cloud's in later rounds; the cloud does not aggregate router rows
(``cloud/strategies/composed.py`` strips them). Rows of experts the device holds for the
first time start from the cloud's values. Held in RAM: a restarted device starts again
from the cloud's router."""

from __future__ import annotations

from typing import Any

import torch

from .base import ObjectiveTerm


class PrivateRouter(ObjectiveTerm):
    """Restores this device's own router rows before training and keeps them after.

    Params: none.
    """

    name = "private_router"
    adds_loss = False

    def before_training(self, model: Any) -> None:
        with torch.no_grad():
            for k, p in model.trainable().items():
                if k.startswith("router.") and k in self.memory:
                    p.copy_(self.memory[k])

    def after_training(self, model: Any) -> None:
        for k, p in model.trainable().items():
            if k.startswith("router."):
                self.memory[k] = p.detach().clone()
