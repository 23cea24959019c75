"""``fusion_hybrid``: sub-MoE devices and Fed-MoE compact devices in one federation (our
design on top of Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610, docs/methods/fed-moe-fusion.md, and
the configured assignment and aggregation parts; README "Fed-MoE server fusion").

No paper has this. Devices whose budget holds ``compact_below`` (default 2) or more
experts per layer train the sub-MoE the assignment part gives them. The others train
the compact model of :mod:`.fusion`, with a smaller batch where needed. The compact model
is the global MoE's single-slot sub-MoE, so the two kinds of update meet on the keys
they share. Server expert i is global expert slot i in every MoE layer, so K = E − 1
routed experts and slot 0 is the main expert E_0. Per round:

- **Backbone LoRA and task heads**: the aggregation part (default ``modular``:
  |D_c|-weighted FedAvg) over *all* accepted updates, from both kinds of device. These
  are the same tensors on the same base in both modes.
- **Router rows**: the aggregation part over the sub-MoE devices only. A compact device
  routes over one expert, so its router row gets no gradient.
- **Expert slot e**: the aggregation part over its sub-MoE holders first (the compact
  devices' expert tensors are left out of it). Then eq. 6, the moving average, runs on
  the expert tensors only: E_0 (slot 0) moves towards mean(M) and E_e towards
  Σ_j W^r[e,j]·M_j. λ is scaled by the compact devices' share of the round's samples
  (λ·n_compact/n_all), so a few small devices cannot pull an expert that many holders
  trained. Backbone and head entries of E_i are shared and stay as aggregated.
- **Gate and α**: trained on D^r exactly as in :mod:`.fusion` (eq. 7-9). P̂_i there is
  the single-slot-i model (global state, slot i moved into slot 0). The gate and α are
  owned tensors next to the global MoE's token routers.
- **Stage C** (eq. 11-13) sends each compact device its own synchronised model.

Evaluation reports the global MoE, as every composed method does (the top-level
figures), and the fused server MoE's top-L inference (eq. 10) under ``fused``.

Where it holds: moving a LoRA delta between expert slots is valid only when the slots
share a base. Upcycled families copy one FFN (up to ``upcycle_noise``), and
full-fine-tune families (``conv-moe``) move weights, not deltas. A Hugging Face MoE
checkpoint has genuinely different pretrained experts, so it is refused.

Raises ValueError for ``hf-moe`` models (with LoRA), fewer than 2 experts, and every
case :class:`.fusion.Fusion` refuses.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

import torch

from moe_model.models.base import trains_all_weights
from protocol import keys

from ..aggregation.base import get_aggregation
from ..assignment.base import get_assignment
from ..strategy import Aggregated, ClientResult, DeviceView, Failure, Plan, Setup
from .base import Strategy
from .fusion import SYNC_PREFIX, Fusion

if TYPE_CHECKING:
    from ..global_model import GlobalModel

log = logging.getLogger(__name__)


def slot_key(name: str, slot: int) -> str:
    """A compact-model key (slot :data:`.fusion.SLOT`, 0) as the same tensor of expert ``slot``:
    ``expert.{l}.0.{path}`` -> ``expert.{l}.{slot}.{path}``, ``router.{l}.0`` ->
    ``router.{l}.{slot}``; backbone and head keys unchanged."""
    k = keys.parse(name)
    if k.group == "expert":
        return keys.expert_key(k.layer, slot, k.path)
    if k.group == "router":
        return keys.router_key(k.layer, slot)
    return name


class FusionHybrid(Fusion):
    """Sub-MoE devices (assignment + aggregation parts) and compact devices (Fed-MoE
    fusion) in one federation; see the module docstring.

    Params: ``compact_below`` (2: devices whose capacity is below it train the compact
    model), and those of :class:`.fusion.Fusion` except ``routed_experts`` (always E − 1).

    Raises:
        ValueError: ``compact_below`` outside 1..E, ``routed_experts`` other than E − 1,
            and what :class:`.fusion.Fusion` refuses.
    """

    name = "fusion_hybrid"

    def __init__(self, setup: Setup, compact_below: int = 2, **params: Any):
        E = setup.num_experts
        if params.pop("routed_experts", E - 1) != E - 1:
            raise ValueError(f"fusion_hybrid: the routed experts are the global experts 1..{E - 1}; "
                             f"routed_experts must be {E - 1} or unset")
        if E < 2:
            raise ValueError("fusion_hybrid needs at least 2 experts per layer (a main and a routed one)")
        if isinstance(compact_below, bool) or not isinstance(compact_below, int) or not 1 <= compact_below <= E:
            raise ValueError(f"fusion_hybrid: compact_below must be in 1..{E}, got {compact_below!r}")
        super().__init__(setup, routed_experts=E - 1, **params)
        self.compact_below = compact_below
        (a_name, a_params), (g_name, g_params) = setup.assignment, setup.aggregation
        self.assignment = get_assignment(a_name)(setup.layers, E, seed=setup.seed, **a_params)
        self.aggregation = get_aggregation(g_name)(**g_params)
        self.compact_devices: set[str] = set()
        """The devices of the current round that train the compact model."""

    @property
    def label(self) -> str:
        return f"{self.name}+{self.assignment.name}"

    def _check_model(self, model: "GlobalModel") -> None:
        if model.spec.family == "hf-moe" and not trains_all_weights(model.spec):
            raise ValueError("fusion_hybrid moves LoRA deltas between expert slots, which needs slots that share a "
                             "base (upcycled or fully fine-tuned); a Hugging Face MoE checkpoint's experts do not")

    def configure_round(self, round: int, devices: list[DeviceView], model: "GlobalModel") -> Plan:
        """Devices below ``compact_below`` experts per layer: the compact model (:meth:`Fusion.configure_round`);
        the others: the assignment part's plan."""
        self._check_model(model)
        small = [d for d in devices if d.capacity < self.compact_below]
        big = [d for d in devices if d.capacity >= self.compact_below]
        plan = self.assignment.configure(round, big) if big else Plan({})
        compact = super().configure_round(round, small, model) if small else Plan({})
        self.compact_devices = set(compact.assignments)
        plan.assignments.update(compact.assignments)
        plan.train.update(compact.train)
        plan.excluded.update(compact.excluded)
        plan.info = {**plan.info, "compact": sorted(self.compact_devices),
                     **({"smaller_batch": compact.info["smaller_batch"]} if "smaller_batch" in compact.info else {})}
        return plan

    def state_for(self, device_id: str, task: str, experts, model: "GlobalModel") -> dict:
        """A compact device: its synchronised model (:meth:`Fusion.state_for`); others: their slice."""
        if device_id in self.compact_devices:
            return super().state_for(device_id, task, experts, model)
        return Strategy.state_for(self, device_id, task, experts, model)

    def experts_of(self, model: "GlobalModel", state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``(E, P)`` float64: row i the single-slot-i model of ``state`` (default the global
        state) in the compact layout (slot i moved into slot 0)."""
        state = model.state if state is None else state
        return torch.stack([torch.cat([state[slot_key(k, i)].double().reshape(-1) for k, _ in self.layout(model)])
                            for i in range(self.k + 1)])

    def aggregate(self, round: int, model: "GlobalModel", results: list[ClientResult],
                  failures: list[Failure]) -> Aggregated:
        """The aggregation part over sub-MoE updates and the compact updates' shared keys, then
        Fed-MoE fusion on the expert tensors (see the module docstring)."""
        compact = [r for r in self.compact_results(model, results) if r.device_id in self.compact_devices]
        ids = {r.device_id for r in compact}
        shared = [replace(r, state={k: v for k, v in r.state.items()
                                    if keys.parse(k).group not in ("expert", "router")}) for r in compact]
        state = self.aggregation.aggregate(round, model.state, [r for r in results if r.device_id not in ids] + shared,
                                           failures)
        if not compact:
            return Aggregated(state, None, {"compact_clients": 0})
        n_compact, n_all = sum(r.num_samples for r in compact), sum(r.num_samples for r in results)
        lam = self.lam * n_compact / max(n_all, 1)
        log.info("round %d: fusion_hybrid: %d sub-MoE and %d compact updates, step-3 lambda %.3f", round,
                 len(results) - len(compact), len(compact), lam)
        mask = torch.cat([torch.full((math.prod(shape),), keys.parse(k).group == "expert")
                          for k, shape in self.layout(model)])
        experts, synced, gate, metrics = self.fuse(model, self.experts_of(model, state), compact, lam, mask)
        for i in range(self.k + 1):
            for k, t in self.unflatten(experts[i], model).items():
                if keys.parse(k).group == "expert":
                    state[slot_key(k, i)] = t
        owned = {**model.owned, **gate}
        owned.update({SYNC_PREFIX + r.device_id: synced[j].float() for j, r in enumerate(compact)})
        return Aggregated(state, owned, {**metrics, "compact_clients": len(compact), "lambda_step3": lam,
                                         "sub_moe_clients": len(results) - len(compact)})

    def evaluate(self, round: int, model: "GlobalModel", eval_data: dict[str, Sequence[tuple[Any, int]]],
                 batch_size: int = 32) -> dict[str, Any]:
        """The global MoE (:meth:`Strategy.evaluate`), with the fused server MoE's top-L
        inference (eq. 10, :meth:`Fusion.evaluate`) under ``fused``."""
        out = Strategy.evaluate(self, round, model, eval_data, batch_size)
        fused = super().evaluate(round, model, eval_data, batch_size)
        return {**out, "fused": {"accuracy": fused["accuracy"], "loss": fused["loss"]}}

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        self.assignment.observe(round, [r for r in results if r.device_id not in self.compact_devices], failures)

    def state_dict(self) -> dict[str, Any]:
        return {"assignment": self.assignment.state_dict(), "aggregation": self.aggregation.state_dict(),
                "compact_devices": sorted(self.compact_devices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.assignment.load_state_dict(state.get("assignment", {}))
        self.aggregation.load_state_dict(state.get("aggregation", {}))
        self.compact_devices = set(state.get("compact_devices", []))

