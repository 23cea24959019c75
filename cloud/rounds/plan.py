"""The strategy's plan for a round (:class:`cloud.strategy.Plan`): completed with the
configured objective terms and the evaluation term, and checked entry by entry (an
invalid entry excludes that device with the reason, never the round)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError

from protocol.codec import extra_tensor_problem
from protocol.messages import (
    MAX_OBJECTIVES, MIN_MINOR_FOR_EVALUATION, MIN_MINOR_FOR_EXTENSIONS, ExtraName, Objective, TrainConfig,
)

from ..strategy import DeviceView, Plan
from .eligibility import Excluded
from .state import EngineState, OpenRound

log = logging.getLogger(__name__)


class PlanChecks(EngineState):
    """The round engine's plan completion and checks (a part of :class:`cloud.rounds.RoundEngine`)."""

    def _finish_plan(self, number: int, plan: Plan, views: list[DeviceView], excluded: Excluded) -> None:
        """Drop ``plan``'s invalid entries (:meth:`_invalid_entries`, logged), add the
        configured and evaluation terms, and enter in ``excluded`` every device of ``views``
        the plan leaves out, with why (a device the plan assigns is not excluded)."""
        for d, why in self._invalid_entries(plan, views).items():
            log.error("round %d: %s; %s sits this round out", number, why, d)
            plan.assignments.pop(d, None)
            excluded[d] = (why, {})
        for d in plan.assignments:  # a strategy may fit a device below one expert per layer (a smaller batch)
            excluded.pop(d, None)
        self._add_configured_objectives(plan)
        self._ask_evaluation(number, plan, views)
        for v in views:
            if v.device_id not in plan.assignments and v.device_id not in excluded:
                excluded[v.device_id] = (plan.excluded.get(v.device_id) or f"the '{self.strategy.label}' strategy "
                                         f"gave it no experts this round (its budget holds {v.capacity} per layer)", {})

    def _add_configured_objectives(self, plan: Plan) -> None:
        """Add the strategy's configured terms (``strategy.params.objectives``) to every
        assigned device's plan, after the terms the method planned (none named twice)."""
        for d in plan.assignments:
            planned = list(plan.objectives.get(d) or [])
            names = {getattr(o, "name", None) for o in planned}
            extra = [o for o in self.strategy.objectives if o.name not in names]
            if extra:
                plan.objectives[d] = [*planned, *extra]

    def _ask_evaluation(self, number: int, plan: Plan, views: list[DeviceView]) -> None:
        """Add the evaluation term to the plan of the devices the strategy's
        :meth:`Strategy.configure_evaluate` names (those of protocol minor >= 3; a
        strategy bug there is logged and evaluation skipped for the round)."""
        planned = [v for v in views if v.device_id in plan.assignments]
        try:
            ask = set(self.strategy.configure_evaluate(number, planned))
        except Exception:
            log.exception("round %d: the strategy's configure_evaluate failed; no federated evaluation", number)
            return
        term = self.strategy.EVALUATION_TERM
        for v in planned:
            objectives = list(plan.objectives.get(v.device_id) or [])
            if v.device_id in ask and v.protocol_minor >= MIN_MINOR_FOR_EVALUATION and \
                    len(objectives) < MAX_OBJECTIVES and all(getattr(o, "name", None) != term for o in objectives):
                plan.objectives[v.device_id] = [*objectives, Objective(name=term)]

    def _invalid_entries(self, plan: Plan, views: list[DeviceView]) -> dict[str, str]:
        """device -> why the strategy's plan for it cannot be sent: not a selected device,
        experts not covering each MoE layer with 1..E distinct ids, more than its budget
        holds, a training override the schema refuses, or objectives and extra tensors
        for a device older than protocol minor 2 or ill-formed."""
        by_id, bad = {v.device_id: v for v in views}, {}
        who = f"the '{self.strategy.label}' strategy's plan"
        E = self.model.spec.num_experts
        for d, experts in plan.assignments.items():
            view = by_id.get(d)
            if view is None:
                bad[d] = f"{who} names {d}, which was not selected"
                continue
            layers_ok = set(experts) == set(self.model.layers) and all(
                v and len(set(v)) == len(v)
                and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < E for e in v)
                for v in experts.values())
            if not layers_ok:
                bad[d] = f"{who} gives it experts {experts}, not 1..{E} distinct ids for each of layers " \
                         f"{self.model.layers}"
                continue
            # Per-layer counts may differ: beyond the uniform capacity, the memory estimate decides.
            over = any(len(v) > max(view.capacity, 1) for v in experts.values()) and (
                view.memory is None or view.memory(experts) > view.budget_bytes)
            if over:
                bad[d] = f"{who} gives it {[len(v) for v in experts.values()]} experts per layer, more than its " \
                         f"budget of {view.budget_bytes / 2**20:.0f} MiB holds"
                continue
            try:
                self._train_for_overrides(plan.train.get(d))
            except ValidationError as e:
                bad[d] = f"{who} sets invalid training overrides: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
                continue
            objectives, tensors = plan.objectives.get(d) or [], plan.tensors.get(d) or {}
            if (objectives or tensors) and view.protocol_minor < MIN_MINOR_FOR_EXTENSIONS:
                bad[d] = (f"{who} needs objective terms or extra tensors, which its SDK (protocol minor "
                          f"{view.protocol_minor}) cannot use; update the device SDK to minor "
                          f"{MIN_MINOR_FOR_EXTENSIONS} or later")
                continue
            problem = tensors_problem(tensors) or next(
                (f"objective {o!r} is not an Objective" for o in objectives if not isinstance(o, Objective)), None) or (
                f"{len(objectives)} objective terms, more than {MAX_OBJECTIVES}" if len(objectives) > MAX_OBJECTIVES
                else None)
            if problem:
                bad[d] = f"{who} for it is ill-formed: {problem}"
        return bad

    def _train_for(self, rnd: OpenRound, device_id: str) -> TrainConfig:
        """The training configuration ``device_id``'s assignment carries this round."""
        return self._train_for_overrides(rnd.train.get(device_id))

    def _train_for_overrides(self, overrides: dict[str, Any] | None) -> TrainConfig:
        """The round's training configuration with a plan's per-device ``overrides``.

        Raises:
            pydantic.ValidationError: an unknown field or a value out of range.
        """
        return TrainConfig.model_validate({**self.settings.train.model_dump(), **overrides}) if overrides else \
            self.settings.train


_EXTRA_NAME = TypeAdapter(ExtraName)
MAX_EXTRA_TENSOR_BYTES = 64 * 1024**2
"""Largest total size of one device's extra tensors in a round, in bytes."""


def tensors_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why a plan's extra tensors for one device cannot be sent, or None: each name is a
    ``namespace.name`` outside the adapter state's namespaces, each tensor float32 or
    int64 and finite, at most :data:`MAX_EXTRA_TENSOR_BYTES` in all."""
    total = 0
    for name, t in tensors.items():
        try:
            _EXTRA_NAME.validate_python(name)
        except ValidationError:
            return f"extra tensor name {name!r} is not 'namespace.name' (lower-case namespace)"
        if name.split(".", 1)[0] in ("backbone", "expert", "router", "head"):
            return f"extra tensor name {name!r} uses an adapter-state namespace"
        problem = extra_tensor_problem(t)
        if problem:
            return f"extra tensor {name!r} {problem}"
        if t.dim() > 8:
            return f"extra tensor {name!r} has more than 8 dimensions"
        total += t.numel() * t.element_size()
    if total > MAX_EXTRA_TENSOR_BYTES:
        return f"extra tensors of {total} bytes exceed {MAX_EXTRA_TENSOR_BYTES}"
    return None
