"""A toy federated method in one module, written only against the strategy API.

It exercises every extension point a new paper needs, with no change to the engine,
the protocol package or the client (README "Adding a method"):

- cloud (:class:`ToyStrategy`, name ``toy``): composed from the configured assignment
  and aggregation parts; each round it sends every device an extra tensor
  ``toy.offset`` (the number of rounds aggregated so far) and turns on the objective
  term ``toy_l2`` with the parameter ``weight``; it refuses statistics without the
  term's report, reads the reported penalties back up, and keeps two tensors of its own
  in the global model (``toy.rounds``: rounds aggregated; ``toy.penalty``: the last mean
  penalty).
- device (:class:`ToyL2`, name ``toy_l2``): ``weight * sum(B²)`` over the trainable
  LoRA-B factors, reported after training as ``toy_l2.penalty`` together with the
  weight and offset it received (``toy_l2.echo``).
"""

from __future__ import annotations

from typing import Any

import torch

from cloud.strategies import Composed
from cloud.strategy import Aggregated, Plan, Setup
from edge_sdk.objectives import ObjectiveTerm, TermContext
from protocol.messages import Objective, Stats


class ToyStrategy(Composed):
    """Params: ``weight`` (float > 0), the ``toy_l2`` term's weight."""

    name = "toy"

    def __init__(self, setup: Setup, weight: float = 0.1, **params: Any):
        super().__init__(setup, **params)
        if not weight > 0:
            raise ValueError("toy: weight must be > 0")
        self.weight = float(weight)
        self.sent: dict[int, float] = {}
        """round -> the offset sent that round."""

    def configure_round(self, round, devices, model) -> Plan:
        plan = super().configure_round(round, devices, model)
        offset = model.owned.get("toy.rounds", torch.zeros(1, dtype=torch.int64)).to(torch.float32)
        self.sent[round] = float(offset)
        for d in plan.assignments:
            plan.tensors[d] = {"toy.offset": offset}
            plan.objectives[d] = [Objective(name="toy_l2", params={"weight": self.weight})]
        return plan

    def stats_problem(self, device_id: str, stats: Stats) -> str | None:
        penalty, echo = stats.extras.get("toy_l2.penalty"), stats.extras.get("toy_l2.echo")
        if penalty is None or len(penalty) != 1 or penalty[0] < 0 or echo is None or len(echo) != 2:
            return "toy: extras lack a valid toy_l2.penalty and toy_l2.echo"
        return None

    def aggregate(self, round, model, results, failures) -> Aggregated:
        out = super().aggregate(round, model, results, failures)
        penalties = {r.device_id: r.stats.extras["toy_l2.penalty"][0] for r in results}
        echoes = {r.device_id: r.stats.extras["toy_l2.echo"] for r in results}
        rounds = model.owned.get("toy.rounds", torch.zeros(1, dtype=torch.int64)) + 1
        mean = torch.tensor([sum(penalties.values()) / len(penalties)], dtype=torch.float32)
        return Aggregated(out.state, {"toy.rounds": rounds, "toy.penalty": mean},
                          {"penalties": penalties, "echoes": echoes, "offset_sent": self.sent.get(round)})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sent": {str(k): v for k, v in self.sent.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sent = {int(k): v for k, v in state.get("sent", {}).items()}


class ToyL2(ObjectiveTerm):
    """``weight * sum(B²)`` over the trainable LoRA-B factors; needs ``toy.offset``."""

    name = "toy_l2"

    def __init__(self, params: dict[str, Any], ctx: TermContext):
        super().__init__(params, ctx)
        self.weight = self.param("weight", lo=0.0, hi=100.0)
        if "toy.offset" not in ctx.tensors:
            raise ValueError("toy_l2 needs the extra tensor toy.offset")
        self.offset = float(ctx.tensors["toy.offset"].sum())
        self.last = 0.0

    def __call__(self, model, batch, logits) -> torch.Tensor:
        total = logits.new_zeros(())
        for k, p in model.trainable().items():
            if k.endswith("lora_B"):
                total = total + p.pow(2).sum()
        value = self.weight * total
        self.last = float(value.detach())
        return value

    def statistics(self) -> dict[str, list[float]]:
        return {"penalty": [self.last], "echo": [self.weight, self.offset]}
