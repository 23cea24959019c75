"""``evaluate_received``: federated evaluation. Before local training, the device
evaluates the sub-MoE it starts the round from (the global state it received; with
FLEX-MoE's ``private_router``, which runs first, its own router rows) on its local
validation split and reports
accuracy, loss and the number of samples (``Stats.extras``: ``evaluate_received.accuracy``,
``.loss``, ``.samples``; one value each). The cloud asks for it through
``Strategy.configure_evaluate``; nothing else about the data leaves the device."""

from __future__ import annotations

from typing import Any

from .base import ObjectiveTerm


class EvaluateReceived(ObjectiveTerm):
    """Accuracy and mean cross-entropy loss of the received model on the validation split.

    Params: none. Reports nothing when the device holds no validation samples.
    """

    name = "evaluate_received"
    adds_loss = False

    def __init__(self, params: dict[str, Any], ctx):
        super().__init__(params, ctx)
        self._result: dict[str, list[float]] = {}

    def before_training(self, model: Any) -> None:
        if not self.ctx.val_items:
            return
        from moe_model.train import evaluate  # peft and transformers: not for a config check naming the term

        r = evaluate(model, self.ctx.val_items, self.ctx.train.batch_size)  # no_grad; the batch the plan covers
        self._result = {"accuracy": [r.accuracy], "loss": [r.loss], "samples": [float(r.samples)]}

    def statistics(self) -> dict[str, list[float]]:
        return dict(self._result)
