"""``composed``: a method made of an assignment part and an aggregation part.

Every method the aggregator ran before strategies existed is one of these: FedMoE
(``fedmoe`` assignment + ``modular`` aggregation), FLEX-MoE (``flex`` +
``usage_weighted``, with ``train.router: private``), the random and full baselines. The
parts come from the config's ``assignment`` and ``aggregation`` sections.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from edge_sdk.objectives.router_probe import ROWS, RouterProbe
from protocol import keys
from protocol.messages import Objective

from ..aggregation.base import get_aggregation
from ..assignment.base import get_assignment
from ..strategy import Aggregated, ClientResult, DeviceView, Failure, Plan, Setup
from .base import Strategy

if TYPE_CHECKING:
    from ..global_model import GlobalModel


class Composed(Strategy):
    """Assignment part -> plan; aggregation part -> next state.

    With ``train.router: private`` (FLEX-MoE's client-private gating,
    Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 Step 3) the router rows stay on the devices: they are left
    out of aggregation, so the global rows keep their values.

    Args:
        setup: see :class:`Strategy`; ``setup.assignment`` and ``setup.aggregation``
            name the parts.
        **params: none here (subclasses take their own).

    Raises:
        KeyError: an unknown part name. TypeError: unknown part parameters.
    """

    name = "composed"

    def __init__(self, setup: Setup, **params: Any):
        super().__init__(setup, **params)
        (a_name, a_params), (g_name, g_params) = setup.assignment, setup.aggregation
        self.assignment = get_assignment(a_name)(setup.layers, setup.num_experts, seed=setup.seed, **a_params)
        self.aggregation = get_aggregation(g_name)(**g_params)

    @property
    def label(self) -> str:
        return self.assignment.name

    def configure_round(self, round: int, devices: list[DeviceView], model: "GlobalModel") -> Plan:
        """The assignment part's plan, with the inputs of any ``router_probe`` term it asked for
        (:func:`with_router_rows`)."""
        return with_router_rows(self.assignment.configure(round, devices), model)

    def for_aggregation(self, result: ClientResult) -> ClientResult:
        """Without its router rows when the router is private (``train.router: private``)."""
        return _without_router(result) if self.setup.train.router == "private" else result

    def evaluated_experts(self, model: "GlobalModel") -> dict[int, list[int]] | None:
        """The assignment part's common sub-MoE (:meth:`AssignmentStrategy.served_experts`), else all."""
        return self.assignment.served_experts()

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        self.assignment.observe(round, results, failures)

    def state_dict(self) -> dict[str, Any]:
        return {"assignment": self.assignment.state_dict(), "aggregation": self.aggregation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.assignment.load_state_dict(state.get("assignment", {}))
        self.aggregation.load_state_dict(state.get("aggregation", {}))


def with_router_rows(plan: Plan, model: "GlobalModel") -> Plan:
    """``plan`` with every ``router_probe`` objective completed: ``top_k`` (the model's) and the
    extra tensor ``router_probe.rows``, every expert's global router row, float32 ``(L, E, H)``
    (L MoE layers ascending, E experts, H hidden size; the device's
    ``edge_sdk.objectives.router_probe`` scores its tokens against them)."""
    wanted = [d for d, terms in plan.objectives.items() if any(o.name == RouterProbe.name for o in terms)]
    if not wanted:
        return plan
    E = model.spec.num_experts
    rows = torch.stack([torch.stack([model.state[keys.router_key(layer, e)].float() for e in range(E)])
                        for layer in sorted(model.layers)])
    term = Objective(name=RouterProbe.name, params={"top_k": min(model.spec.top_k, E)})
    for d in wanted:
        plan.objectives[d] = [term if o.name == RouterProbe.name else o for o in plan.objectives[d]]
        plan.tensors[d] = {**plan.tensors.get(d, {}), ROWS: rows}
    return plan


def _without_router(result: ClientResult) -> ClientResult:
    return replace(result, state={k: v for k, v in result.state.items() if not k.startswith("router.")})
